"""A limit's value: one rate or ceiling parsed exactly, and the errors of
the limit options and files.

Pure logic, below ``config`` (the options) and ``limits_file`` (the file's
parser), which both use it; ``config`` re-exports every name.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

#: Longest user id kept; longer ids are cut (they are still one user each).
MAX_USER_LEN = 256

#: 1e9 tok/s is far beyond any model; above it the integer state only grows.
MAX_RATE = Fraction(10**9)


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
    if rate > MAX_RATE:
        raise OutputRateConfigError(
            f"{option}: {value!r} tokens per second is beyond any model "
            f"(at most {MAX_RATE})"
        )
    return rate


def parse_ceiling(value: Any, option: str) -> Fraction | str:
    """A ceiling: a limit (``parse_rate``) or ``unlimited``."""
    if isinstance(value, str) and value.strip().lower() == UNLIMITED:
        return UNLIMITED
    return parse_rate(value, option)


#: A ceiling no token count bounds (the limits file's ``ceiling: unlimited``).
UNLIMITED = "unlimited"


def ceiling_problem(rate: Fraction, ceiling: Fraction | str | None) -> str | None:
    """Why ``ceiling`` cannot go with ``rate`` (None: it can)."""
    if ceiling not in (None, UNLIMITED) and ceiling < rate:
        return (f"ceiling {ceiling} is below the rate {rate} (a ceiling bounds what is "
                f"borrowed above it)")
    return None


class ConfigFileError(OutputRateConfigError):
    """A file (limits, API keys) that cannot be used: ``errors`` holds every
    error found, one line each (``FILE:LINE: KEY: what, got VALUE``), in the
    file's order."""

    def __init__(self, errors: list[str]) -> None:
        self.errors = list(errors)
        super().__init__("\n".join(self.errors))
