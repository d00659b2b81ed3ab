"""The limits file (``--output-rate-limits-file``): its parser and its JSON
Schema, from the same tables.

``parse_document`` is the one reader of a limits file: the engine's start-up,
its live reloads (``limits_watch``) and ``vllm-output-rate check-limits`` all
call it (through ``config.parse_limits_document``, which makes the
``OutputRateConfig``). It reports every error it
finds, not only the first: keys given twice (``yaml_load``), unknown keys,
and each bad limit of ``default``, ``tiers`` and ``users``, one line each
naming the file, the line, the key and the value.

``schema()`` is the file's shape as a JSON Schema (draft 2020-12), built from
the parser's own constants: what editors and CI validators check. What a
schema cannot say (a user's tier must be one of ``tiers``, a ceiling at or
above its rate, a limit at most ``10**9``) only the parser checks.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Callable

from vllm_output_rate.limit_values import (
    MAX_RATE,
    MAX_USER_LEN,
    UNLIMITED,
    ConfigFileError,
    OutputRateConfigError,
    ceiling_problem,
    parse_ceiling,
    parse_rate,
)
from vllm_output_rate.yaml_load import KeyPath, load_yaml

#: Top-level keys of a limits file.
LIMITS_FILE_KEYS = ("default", "tiers", "users")
#: The keys of a limit written as a mapping (``{rate: R, ceiling: C,
#: prompt_rate: P}``): ``rate`` required, the others optional.
PAIR_KEYS = ("rate", "ceiling", "prompt_rate")

Ceiling = Fraction | str | None
#: A prompt budget: prompt tokens computed per second, ``UNLIMITED``, or
#: None (not given: the default's applies).
PromptRate = Fraction | str | None


@dataclass(frozen=True)
class Limit:
    """One parsed limit: the output rate, its ceiling (borrowing) and its
    prompt budget."""

    rate: Fraction
    ceiling: Ceiling = None
    prompt_rate: PromptRate = None


class _Errors:
    """The errors of one document, each at its line."""

    def __init__(self, path: str, line_of: Callable[[KeyPath], int]) -> None:
        self.path, self.line_of = path, line_of
        self.found: list[tuple[int, str]] = []

    def add(self, keys: KeyPath, what: str) -> None:
        line = self.line_of(keys)
        self.found.append((line, f"{self.path}:{line}: {what}"))

    def raise_any(self) -> None:
        if self.found:
            raise ConfigFileError([m for _, m in sorted(self.found, key=lambda e: e[0])])


def _where(keys: KeyPath) -> str:
    return ".".join(str(k) for k in keys)


def _limit(value: Any, keys: KeyPath, errors: _Errors) -> Limit | None:
    """A rate, or a mapping ``{rate: R, ceiling: C, prompt_rate: P}``;
    None (errors added) when it is not a limit."""
    where, ceiling, prompt_rate, ok = _where(keys), None, None, True
    rate_keys, rate_where = keys, where
    if isinstance(value, dict):
        if sorted(set(map(str, value)) - set(PAIR_KEYS)) or "rate" not in value:
            errors.add(keys, f"{where}: expected a limit or {{rate: R, ceiling: C, "
                             f"prompt_rate: P}}, got {value!r}")
            return None
        for key in ("ceiling", "prompt_rate"):
            if value.get(key) is None:
                continue
            try:
                parsed = parse_ceiling(value[key], f"{where}.{key}")
            except OutputRateConfigError as exc:
                errors.add((*keys, key), str(exc).replace(
                    "tokens per second", "prompt tokens per second") if key == "prompt_rate"
                    else str(exc))
                ok = False
                continue
            if key == "ceiling":
                ceiling = parsed
            else:
                prompt_rate = parsed
        value, rate_keys, rate_where = value["rate"], (*keys, "rate"), f"{where}.rate"
    try:
        rate = parse_rate(value, rate_where)
    except OutputRateConfigError as exc:
        errors.add(rate_keys, str(exc))
        return None
    problem = ceiling_problem(rate, ceiling)
    if problem:
        errors.add(keys, f"{where}: {problem}")
    return Limit(rate, ceiling, prompt_rate) if ok and not problem else None


def parse_document(content: bytes, path: str) -> dict[str, Any]:
    """A limits file's content as the fields of the engine's limits (of
    which ``config.parse_limits_document`` makes the ``OutputRateConfig``).
    ``default``: the limit of users not listed (required); ``tiers``: named
    limits; ``users``: user id -> a limit or a tier name. Limits are numbers of tokens per second,
    exact as on the command line (0.1 is 1/10), or mappings ``{rate, ceiling,
    prompt_rate}``.
    Raises ``ConfigFileError`` with every error found."""
    import yaml  # JSON is YAML: one parser for both

    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigFileError([f"{path}: not UTF-8 text ({exc})"]) from None
    try:
        doc = load_yaml(text, path)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        raise ConfigFileError([f"{path}{line}: not valid YAML or JSON ({exc})"]) from None
    errors = _Errors(path, doc.line_of)
    errors.found += [(d.again, d.message(path)) for d in doc.duplicates]
    data = doc.data
    if not isinstance(data, dict):
        errors.add((), f"expected a mapping with keys {', '.join(LIMITS_FILE_KEYS)}, "
                       f"got {type(data).__name__}")
        errors.raise_any()
    for key in data:
        if key not in LIMITS_FILE_KEYS:
            errors.add((key,), f"{key}: unknown key {key!r} (expected "
                                f"{', '.join(LIMITS_FILE_KEYS)})")
    if "default" not in data:
        errors.add((), "'default' is required (the limit of users not listed)")
        default = None
    else:
        default = _limit(data["default"], ("default",), errors)
    tiers = _tiers(data.get("tiers"), errors)
    users, user_tiers = _users(data.get("users"), tiers, errors)
    errors.raise_any()
    assert default is not None
    named = {t: limit for t, limit in tiers.items() if limit is not None}
    return {"default_rate": default.rate, "user_rates": {u: l.rate for u, l in users.items()},
            "tiers": {t: limit.rate for t, limit in named.items()}, "user_tiers": user_tiers,
            "ceilings": {u: l.ceiling for u, l in users.items() if l.ceiling is not None},
            "tier_ceilings": {t: l.ceiling for t, l in named.items() if l.ceiling is not None},
            "default_ceiling": default.ceiling,
            "prompt_rates": {u: l.prompt_rate for u, l in users.items()
                             if l.prompt_rate is not None},
            "tier_prompt_rates": {t: l.prompt_rate for t, l in named.items()
                                  if l.prompt_rate is not None},
            "default_prompt_rate": default.prompt_rate}


def _mapping(value: Any, key: str, what: str, errors: _Errors) -> dict:
    if value is None or value == []:  # (nothing listed)
        return {}
    if not isinstance(value, dict):
        errors.add((key,), f"{key}: expected a mapping of {what}, got {value!r}")
        return {}
    return value


def _tiers(value: Any, errors: _Errors) -> dict[str, Limit | None]:
    """The tiers: name -> limit (None: named but not a limit, its error added)."""
    tiers: dict[str, Limit | None] = {}
    for name, limit in _mapping(value, "tiers", "tier name -> limit", errors).items():
        if not isinstance(name, str) or not name:
            errors.add(("tiers", name), f"tiers: tier names must be non-empty strings, got {name!r}")
            continue
        tiers[name] = _limit(limit, ("tiers", name), errors)
    return tiers


def _users(value: Any, tiers: dict[str, Limit | None],
           errors: _Errors) -> tuple[dict[str, Limit], dict[str, str]]:
    """The listed users: user -> limit (a tier's resolved), user -> tier."""
    limits: dict[str, Limit] = {}
    user_tiers: dict[str, str] = {}
    spelled: dict[str, Any] = {}
    for key, limit in _mapping(value, "users", "user id -> limit or tier", errors).items():
        keys = ("users", key)
        if isinstance(key, bool) or not isinstance(key, (str, int)) or key == "":
            errors.add(keys, f"users: user ids must be non-empty strings, got {key!r}")
            continue
        user = str(key)
        if len(user) > MAX_USER_LEN:
            errors.add(keys, f"users: user id {user[:40]!r}... is longer than "
                             f"{MAX_USER_LEN} characters")
            continue
        if user in spelled:
            errors.add(keys, f"users.{user}: the user is listed twice (as {spelled[user]!r} "
                             f"at line {errors.line_of(('users', spelled[user]))} and as {key!r})")
            continue
        spelled[user] = key
        tier = limit.strip() if isinstance(limit, str) else None
        if tier in tiers:
            if tiers[tier] is not None:  # (a bad tier's error is said once, at the tier)
                user_tiers[user], limits[user] = tier, tiers[tier]
            continue
        if tier is not None:
            try:
                Fraction(tier)
            except (ValueError, ZeroDivisionError):
                errors.add(keys, f"users.{user}: {limit!r} is neither a limit nor a tier "
                                 f"(tiers: {', '.join(tiers) or 'none'})")
                continue
        parsed = _limit(limit, keys, errors)
        if parsed:
            limits[user] = parsed
    return limits, user_tiers


# -- the JSON Schema ----------------------------------------------------------------

#: A number as a string, as ``fractions.Fraction`` reads it ("20", "0.5",
#: "1e2", "1/3"); the schema cannot say "greater than 0" of a string, the
#: parser does.
_DIGITS = r"\d+(_\d+)*"
NUMBER_PATTERN = (rf"^\s*\+?(({_DIGITS}(\.({_DIGITS})?)?|\.{_DIGITS})([eE][-+]?{_DIGITS})?"
                  rf"|{_DIGITS}\s*/\s*{_DIGITS})\s*$")


def schema() -> dict[str, Any]:
    """The limits file's JSON Schema (draft 2020-12)."""
    rate = {"description": "tokens per second: a number above 0, at most "
                           f"{MAX_RATE}, or the same as a string (\"0.5\", \"1/3\")",
            "anyOf": [{"type": "number", "exclusiveMinimum": 0, "maximum": int(MAX_RATE)},
                      {"type": "string", "pattern": NUMBER_PATTERN}]}
    any_case = "".join(f"[{c.lower()}{c.upper()}]" for c in UNLIMITED)
    ceiling = {"description": f"the most a user may borrow up to, or \"{UNLIMITED}\"",
               "anyOf": [{"$ref": "#/$defs/rate"},
                         {"type": "string", "pattern": rf"^\s*{any_case}\s*$"},
                         {"type": "null"}]}
    nothing = {"description": "nothing listed", "anyOf": [{"type": "null"},
                                                          {"type": "array", "maxItems": 0}]}
    prompt_rate = {"description": "prompt tokens computed per second (prefix-cache hits are "
                                  f"free), or \"{UNLIMITED}\"; not given: the default's",
                   "anyOf": [{"$ref": "#/$defs/rate"},
                             {"type": "string", "pattern": rf"^\s*{any_case}\s*$"},
                             {"type": "null"}]}
    pair = {"type": "object", "required": [PAIR_KEYS[0]], "additionalProperties": False,
            "properties": {PAIR_KEYS[0]: {"$ref": "#/$defs/rate"},
                           PAIR_KEYS[1]: {"$ref": "#/$defs/ceiling"},
                           PAIR_KEYS[2]: {"$ref": "#/$defs/prompt_rate"}}}
    properties = {
        "default": {"description": "the limit of users not listed", "$ref": "#/$defs/limit"},
        "tiers": {"description": "named limits: tier name -> limit",
                  "anyOf": [{"type": "object", "propertyNames": {"minLength": 1},
                             "additionalProperties": {"$ref": "#/$defs/limit"}}, nothing]},
        "users": {"description": "user id -> a limit or the name of a tier",
                  "anyOf": [{"type": "object",
                             "propertyNames": {"minLength": 1, "maxLength": MAX_USER_LEN},
                             "additionalProperties": {"anyOf": [
                                 {"$ref": "#/$defs/limit"}, {"type": "string", "minLength": 1}]}},
                            nothing]},
    }
    assert tuple(properties) == LIMITS_FILE_KEYS
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "vllm-output-rate limits file (--output-rate-limits-file)",
        "type": "object",
        "required": ["default"],
        "additionalProperties": False,
        "properties": properties,
        "$defs": {"rate": rate, "ceiling": ceiling, "prompt_rate": prompt_rate,
                  "limit": {"anyOf": [{"$ref": "#/$defs/rate"}, pair]}},
    }
