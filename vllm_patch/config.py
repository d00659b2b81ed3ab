"""Parsing and validation of the output-rate options.

Pure logic: imports nothing from vLLM. Every error names the option and the
bad value, so a mistyped limit fails at start-up instead of at the first
request.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

DEFAULT_OPTION = "--default-user-output-tokens-per-second"
USERS_OPTION = "--user-output-tokens-per-second"

#: Key under ``VllmConfig.additional_config`` that carries the limits from
#: the front-end process to the engine-core process.
ADDITIONAL_CONFIG_KEY = "output_rate"

#: The user of requests that name none.
ANONYMOUS_USER = "__anonymous__"
#: The request field (``vllm_xargs`` in the OpenAI API) naming the user.
USER_FIELD = "output_rate_user"
#: Longest user id kept; longer ids are cut (they are still one user each).
MAX_USER_LEN = 256

# 1e9 tok/s is far beyond any model; above it the integer state only grows.
_MAX_RATE = Fraction(10**9)


class OutputRateConfigError(ValueError):
    """A limit option has a value that cannot be used."""


def parse_rate(value: Any, option: str) -> Fraction:
    """One limit, in tokens per second, as an exact fraction.

    Accepts positive finite numbers given as int, float or decimal string
    ("20", "0.5", "1e2"). Decimal strings and floats are taken at their
    shortest decimal spelling, so 0.1 means exactly 1/10.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float, str, Fraction)):
        raise OutputRateConfigError(
            f"{option}: expected a number of tokens per second, got {value!r}"
        )
    text = value.strip() if isinstance(value, str) else value
    try:
        if isinstance(text, float):
            if not math.isfinite(text):
                raise ValueError
            rate = Fraction(repr(text))
        else:
            rate = Fraction(text)
    except (ValueError, ZeroDivisionError, OverflowError):
        raise OutputRateConfigError(
            f"{option}: expected a positive finite number of tokens per second, "
            f"got {value!r}"
        ) from None
    if rate <= 0:
        raise OutputRateConfigError(
            f"{option}: a limit must be greater than 0 tokens per second, "
            f"got {value!r}"
        )
    if rate > _MAX_RATE:
        raise OutputRateConfigError(
            f"{option}: {value!r} tokens per second is beyond any model "
            f"(at most {_MAX_RATE})"
        )
    return rate


def parse_user_rates(value: Any, option: str = USERS_OPTION) -> dict[str, Fraction]:
    """The per-user overrides: a JSON object of user id -> tokens per second."""
    if value is None:
        return {}
    if isinstance(value, str):
        if not value.strip():
            return {}
        try:
            value = json.loads(value, parse_constant=_reject_constant)
        except (json.JSONDecodeError, ValueError) as exc:
            raise OutputRateConfigError(
                f"{option}: expected a JSON object of user -> tokens per second, "
                f"got {value!r} ({exc})"
            ) from None
    if not isinstance(value, dict):
        raise OutputRateConfigError(
            f"{option}: expected a JSON object of user -> tokens per second, "
            f"got {value!r}"
        )
    rates: dict[str, Fraction] = {}
    for user, rate in value.items():
        if not isinstance(user, str) or not user:
            raise OutputRateConfigError(
                f"{option}: user ids must be non-empty strings, got {user!r}"
            )
        if len(user) > MAX_USER_LEN:
            raise OutputRateConfigError(
                f"{option}: user id {user[:40]!r}... is longer than "
                f"{MAX_USER_LEN} characters"
            )
        rates[user] = parse_rate(rate, f"{option} (user {user!r})")
    return rates


def _reject_constant(name: str) -> Any:
    # json.loads accepts NaN / Infinity by default; a limit never may.
    raise ValueError(f"{name} is not a valid limit")


@dataclass(frozen=True)
class OutputRateConfig:
    """The limits of one engine. Present means the feature is on."""

    default_rate: Fraction
    user_rates: dict[str, Fraction] = field(default_factory=dict)

    @classmethod
    def from_options(
        cls, default: Any, users: Any = None
    ) -> OutputRateConfig | None:
        """From the two CLI options; None (feature off) without a default."""
        if default is None:
            if users not in (None, "", {}):
                raise OutputRateConfigError(
                    f"{USERS_OPTION} needs {DEFAULT_OPTION}: without a default "
                    f"limit the feature is off, so the overrides would be ignored"
                )
            return None
        return cls(parse_rate(default, DEFAULT_OPTION), parse_user_rates(users))

    def to_dict(self) -> dict[str, Any]:
        """Plain data for ``VllmConfig.additional_config`` (exact, as strings)."""
        return {
            "default_user_output_tokens_per_second": str(self.default_rate),
            "user_output_tokens_per_second": {
                u: str(r) for u, r in self.user_rates.items()
            },
        }

    @classmethod
    def from_dict(cls, data: Any) -> OutputRateConfig:
        """Inverse of ``to_dict``; also what Python API users pass."""
        if not isinstance(data, dict):
            raise OutputRateConfigError(
                f"additional_config[{ADDITIONAL_CONFIG_KEY!r}]: expected an object, "
                f"got {data!r}"
            )
        unknown = set(data) - {
            "default_user_output_tokens_per_second",
            "user_output_tokens_per_second",
        }
        if unknown:
            raise OutputRateConfigError(
                f"additional_config[{ADDITIONAL_CONFIG_KEY!r}]: unknown keys "
                f"{sorted(unknown)}"
            )
        if data.get("default_user_output_tokens_per_second") is None:
            raise OutputRateConfigError(
                f"additional_config[{ADDITIONAL_CONFIG_KEY!r}]: "
                f"'default_user_output_tokens_per_second' is required"
            )
        config = cls.from_options(
            data["default_user_output_tokens_per_second"],
            data.get("user_output_tokens_per_second"),
        )
        assert config is not None
        return config

    def rate_of(self, user: str) -> Fraction:
        return self.user_rates.get(user, self.default_rate)


def resolve_user(extra_args: Any) -> str:
    """The user of a request from ``SamplingParams.extra_args``.

    Missing, None or empty -> the shared anonymous user. Other scalars are
    taken as their string form; ids are cut to ``MAX_USER_LEN`` characters.
    Never raises: a malformed field must not fail a request in the engine.
    """
    if not extra_args:
        return ANONYMOUS_USER
    try:
        value = extra_args.get(USER_FIELD)
    except AttributeError:
        return ANONYMOUS_USER
    if value is None or value == "":
        return ANONYMOUS_USER
    if not isinstance(value, str):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = str(value)
        else:
            return ANONYMOUS_USER
    return value[:MAX_USER_LEN]
