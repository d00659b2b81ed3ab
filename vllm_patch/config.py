"""Parsing and validation of the output-rate options.

Pure logic: imports nothing from vLLM. Every error names the option and the
bad value, so a mistyped limit fails at start-up instead of at the first
request.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field, replace
from fractions import Fraction
from typing import Any

from vllm_output_rate.limit_values import (  # (their home was here: still importable from here)
    MAX_USER_LEN,
    UNLIMITED,
    ConfigFileError,
    OutputRateConfigError,
    ceiling_problem,
    parse_ceiling,
    parse_rate,
)
from vllm_output_rate.shared_settings import SHARED_STATE_OPTION, SharedStateError, parse_shared_state

DEFAULT_OPTION = "--output-rate-default-tokens-per-second"
USERS_OPTION = "--output-rate-user-tokens-per-second"
#: Their first names, still accepted.
DEFAULT_OPTION_ALIAS = "--default-user-output-tokens-per-second"
USERS_OPTION_ALIAS = "--user-output-tokens-per-second"
PROMPT_OPTION = "--output-rate-default-prompt-tokens-per-second"
#: The spelling issue 48 and the older options use, still accepted.
PROMPT_OPTION_ALIAS = "--default-user-prompt-tokens-per-second"
LIMITS_FILE_OPTION = "--output-rate-limits-file"
PREFILL_AHEAD_OPTION = "--output-rate-prefill-ahead"
UNLISTED_OPTION = "--output-rate-unlisted-users"

#: Key under ``VllmConfig.additional_config`` that carries the limits from
#: the front-end process to the engine-core process.
ADDITIONAL_CONFIG_KEY = "output_rate"

#: The user of requests that name none.
ANONYMOUS_USER = "__anonymous__"
#: The request field (``vllm_xargs`` in the OpenAI API) naming the user.
USER_FIELD = "output_rate_user"
#: The request field the API server sets to say where a trusted user came
#: from ("header" or "api_key"); a client's own value is removed.
TRUSTED_FIELD = "output_rate_identity"
#: The request fields the API server sets to carry the request's W3C trace
#: context (its ``traceparent`` / ``tracestate`` headers) to the engine when
#: the project's traces are on: vLLM passes its own ``trace_headers`` only
#: with ``--otlp-traces-endpoint``.
TRACEPARENT_FIELD = "output_rate_traceparent"
TRACESTATE_FIELD = "output_rate_tracestate"
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


#: How users missing from the limits are budgeted: each its own default
#: budget ("own", as without a file) or one shared default budget ("shared").
UNLISTED_MODES = ("own", "shared")
#: The user every unlisted id is charged as in "shared" mode.
UNLISTED_USER = "__unlisted__"

_CONFIG_KEYS = {
    "default_user_output_tokens_per_second",
    "user_output_tokens_per_second",
    "tiers",
    "user_tiers",
    "limits_file",
    "digest",
    "unlisted_users",
    "shared_state",
    "ceilings",
    "tier_ceilings",
    "default_ceiling",
    "prompt_rates",
    "tier_prompt_rates",
    "default_prompt_rate",
    "prefill_ahead",
}

@dataclass(frozen=True)
class OutputRateConfig:
    """The limits of one engine. Present means the feature is on.

    ``user_rates`` is what the limiter reads (every listed user's limit, a
    tier already resolved); ``tiers`` and ``user_tiers`` say where a limit
    came from (introspection). ``limits_file`` is the file the engine core
    keeps reloading (None: the command-line options, fixed). ``digest`` is
    the SHA-256 of what the limits were read from. ``shared_state``: the
    store URL of shared-budget mode (``vllm_output_rate.shared_limiter``), or
    None (each engine its own budgets).

    Borrowing (``vllm_output_rate.borrowing``): a limit written as a pair
    ``{rate: R, ceiling: C}`` makes R the guaranteed rate and C (a number or
    ``UNLIMITED``) the ceiling up to which the user may use capacity nobody
    within its guaranteed rate uses. ``ceilings`` holds the listed users'
    ceilings (a listed user without one does not borrow),
    ``default_ceiling`` that of unlisted users (None: they do not borrow),
    ``tier_ceilings`` where they came from.
    """

    default_rate: Fraction
    user_rates: dict[str, Fraction] = field(default_factory=dict)
    tiers: dict[str, Fraction] = field(default_factory=dict)
    user_tiers: dict[str, str] = field(default_factory=dict)
    limits_file: str | None = None
    digest: str = ""
    unlisted_users: str = "own"
    shared_state: str | None = None
    ceilings: dict[str, Fraction | str] = field(default_factory=dict)
    tier_ceilings: dict[str, Fraction | str] = field(default_factory=dict)
    default_ceiling: Fraction | str | None = None
    prompt_rates: dict[str, Fraction | str] = field(default_factory=dict)
    tier_prompt_rates: dict[str, Fraction | str] = field(default_factory=dict)
    default_prompt_rate: Fraction | str | None = None
    #: compute the prompts of users out of budget ahead of their budget
    #: (off: just in time, ``PREFILL_AHEAD_OPTION``)
    prefill_ahead: bool = False

    def __post_init__(self) -> None:
        if not self.digest:
            object.__setattr__(self, "digest", _digest_of(self._limits_dict()))
        if self.unlisted_users not in UNLISTED_MODES:
            raise OutputRateConfigError(
                f"{UNLISTED_OPTION}: expected one of {', '.join(UNLISTED_MODES)}, "
                f"got {self.unlisted_users!r}"
            )
        if self.shared_state is not None:
            try:
                parse_shared_state(self.shared_state)
            except SharedStateError as exc:
                raise OutputRateConfigError(str(exc)) from None
        for user, ceiling in [*self.ceilings.items(), (None, self.default_ceiling)]:
            problem = ceiling_problem(self.default_rate if user is None else self.rate_of(user),
                                      ceiling)
            if problem:
                raise OutputRateConfigError(
                    f"{'default' if user is None else f'users.{user}'}: {problem}")

    @property
    def borrowing(self) -> bool:
        """Whether any user may borrow (a ceiling is set somewhere)."""
        return bool(self.ceilings) or self.default_ceiling is not None

    @property
    def prompt_budgets(self) -> bool:
        """Whether any user's prompt work is budgeted (a ``prompt_rate`` set
        somewhere, other than ``unlimited``)."""
        return any(r != UNLIMITED for r in (*self.prompt_rates.values(),
                                             self.default_prompt_rate) if r is not None)

    def prompt_rate_of(self, user: str) -> Fraction | None:
        """``user``'s prompt budget in prompt tokens per second, or None (its
        prompts are not budgeted): its own ``prompt_rate`` (a tier's
        included), else the default's."""
        rate = self.prompt_rates.get(user) if user in self.user_rates else None
        if rate is None:
            rate = self.default_prompt_rate
        return None if rate is None or rate == UNLIMITED else rate

    def ceiling_of(self, user: str) -> Fraction | str | None:
        """``user``'s ceiling: a rate, ``UNLIMITED``, or None (no borrowing)."""
        return self.ceilings.get(user) if user in self.user_rates else self.default_ceiling

    @classmethod
    def from_options(
        cls, default: Any, users: Any = None, limits_file: Any = None,
        unlisted_users: Any = None, shared_state: Any = None, default_prompt: Any = None,
        prefill_ahead: bool = False,
    ) -> OutputRateConfig | None:
        """From the CLI options; None (feature off) without a default limit
        or a limits file."""
        prompt = default_prompt not in (None, "")
        if prompt and limits_file not in (None, ""):
            raise OutputRateConfigError(
                f"{PROMPT_OPTION} cannot be combined with {LIMITS_FILE_OPTION}: the "
                f"file's 'default' holds it ({{rate: R, prompt_rate: P}})")
        config = cls._from_limit_options(default, users, limits_file, unlisted_users)
        if prefill_ahead:
            if config is None:
                raise OutputRateConfigError(
                    f"{PREFILL_AHEAD_OPTION} needs {DEFAULT_OPTION} or {LIMITS_FILE_OPTION}: "
                    f"without limits the feature is off")
            config = replace(config, prefill_ahead=True)
        if prompt:
            if config is None:
                raise OutputRateConfigError(
                    f"{PROMPT_OPTION} needs {DEFAULT_OPTION}: without limits the feature "
                    f"is off")
            config = replace(config, default_prompt_rate=parse_ceiling(
                default_prompt, PROMPT_OPTION))
        if shared_state in (None, ""):
            return config
        if config is None:
            raise OutputRateConfigError(
                f"{SHARED_STATE_OPTION} needs {DEFAULT_OPTION} or {LIMITS_FILE_OPTION}: "
                f"without limits the feature is off")
        return replace(config, shared_state=str(shared_state).strip())

    @classmethod
    def _from_limit_options(
        cls, default: Any, users: Any, limits_file: Any, unlisted_users: Any,
    ) -> OutputRateConfig | None:
        if limits_file not in (None, ""):
            if default is not None or users not in (None, "", {}):
                raise OutputRateConfigError(
                    f"{LIMITS_FILE_OPTION} cannot be combined with {DEFAULT_OPTION} "
                    f"or {USERS_OPTION}: the file holds the default and every "
                    f"user's limit (its 'default' and 'users' keys)"
                )
            config = load_limits_file(str(limits_file))
            if unlisted_users is not None:
                config = replace(config, unlisted_users=_unlisted_mode(unlisted_users))
            return config
        if default is None:
            if users not in (None, "", {}):
                raise OutputRateConfigError(
                    f"{USERS_OPTION} needs {DEFAULT_OPTION}: without a default "
                    f"limit the feature is off, so the overrides would be ignored"
                )
            if unlisted_users is not None:
                raise OutputRateConfigError(
                    f"{UNLISTED_OPTION} needs {DEFAULT_OPTION} or "
                    f"{LIMITS_FILE_OPTION}: without limits the feature is off"
                )
            return None
        return cls(parse_rate(default, DEFAULT_OPTION), parse_user_rates(users),
                   unlisted_users=_unlisted_mode(unlisted_users or "own"))

    def _limits_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "default_user_output_tokens_per_second": str(self.default_rate),
            "user_output_tokens_per_second": {
                u: str(r) for u, r in self.user_rates.items()
            },
        }
        if self.tiers:
            data["tiers"] = {t: str(r) for t, r in self.tiers.items()}
        if self.user_tiers:
            data["user_tiers"] = dict(self.user_tiers)
        if self.ceilings:
            data["ceilings"] = {u: str(c) for u, c in self.ceilings.items()}
        if self.tier_ceilings:
            data["tier_ceilings"] = {t: str(c) for t, c in self.tier_ceilings.items()}
        if self.default_ceiling is not None:
            data["default_ceiling"] = str(self.default_ceiling)
        if self.prompt_rates:
            data["prompt_rates"] = {u: str(r) for u, r in self.prompt_rates.items()}
        if self.tier_prompt_rates:
            data["tier_prompt_rates"] = {t: str(r) for t, r in self.tier_prompt_rates.items()}
        if self.default_prompt_rate is not None:
            data["default_prompt_rate"] = str(self.default_prompt_rate)
        return data

    def to_dict(self) -> dict[str, Any]:
        """Plain data for ``VllmConfig.additional_config`` (exact, as strings)."""
        data = self._limits_dict()
        if self.limits_file is not None:
            # (the options' digest is recomputed from their values)
            data["limits_file"] = self.limits_file
            data["digest"] = self.digest
        if self.unlisted_users != "own":
            data["unlisted_users"] = self.unlisted_users
        if self.shared_state is not None:
            data["shared_state"] = self.shared_state
        if self.prefill_ahead:
            data["prefill_ahead"] = True
        return data

    @classmethod
    def from_dict(cls, data: Any) -> OutputRateConfig:
        """Inverse of ``to_dict``; also what Python API users pass."""
        where = f"additional_config[{ADDITIONAL_CONFIG_KEY!r}]"
        if not isinstance(data, dict):
            raise OutputRateConfigError(f"{where}: expected an object, got {data!r}")
        unknown = set(data) - _CONFIG_KEYS
        if unknown:
            raise OutputRateConfigError(f"{where}: unknown keys {sorted(unknown)}")
        if data.get("default_user_output_tokens_per_second") is None:
            raise OutputRateConfigError(
                f"{where}: 'default_user_output_tokens_per_second' is required"
            )
        tiers = {
            str(t): parse_rate(r, f"{where} (tier {t!r})")
            for t, r in (data.get("tiers") or {}).items()
        }
        user_tiers = {str(u): str(t) for u, t in (data.get("user_tiers") or {}).items()}
        missing = sorted(set(user_tiers.values()) - set(tiers))
        if missing:
            raise OutputRateConfigError(f"{where}: users name unknown tiers {missing}")
        return cls(
            parse_rate(data["default_user_output_tokens_per_second"], DEFAULT_OPTION),
            parse_user_rates(data.get("user_output_tokens_per_second")),
            tiers=tiers,
            user_tiers=user_tiers,
            limits_file=data.get("limits_file"),
            digest=str(data.get("digest") or ""),
            unlisted_users=_unlisted_mode(data.get("unlisted_users") or "own"),
            shared_state=data.get("shared_state"),
            prefill_ahead=bool(data.get("prefill_ahead", False)),
            ceilings={str(u): parse_ceiling(c, f"{where} (ceiling of {u!r})")
                      for u, c in (data.get("ceilings") or {}).items()},
            tier_ceilings={str(t): parse_ceiling(c, f"{where} (ceiling of tier {t!r})")
                           for t, c in (data.get("tier_ceilings") or {}).items()},
            default_ceiling=(None if data.get("default_ceiling") is None else
                             parse_ceiling(data["default_ceiling"], f"{where} (default ceiling)")),
            prompt_rates={str(u): parse_ceiling(r, f"{where} (prompt rate of {u!r})")
                          for u, r in (data.get("prompt_rates") or {}).items()},
            tier_prompt_rates={str(t): parse_ceiling(r, f"{where} (prompt rate of tier {t!r})")
                               for t, r in (data.get("tier_prompt_rates") or {}).items()},
            default_prompt_rate=(None if data.get("default_prompt_rate") is None else parse_ceiling(
                data["default_prompt_rate"], f"{where} (default prompt rate)")),
        )

    def rate_of(self, user: str) -> Fraction:
        return self.user_rates.get(user, self.default_rate)

    def tier_of(self, user: str) -> str | None:
        """The tier a listed user's limit comes from, if it names one."""
        return self.user_tiers.get(user)

    def charged_user(self, user: str) -> str:
        """Whose budget a request of ``user`` spends: ``user`` itself, or in
        "shared" mode the one ``UNLISTED_USER`` when ``user`` is not listed
        (the anonymous user is one shared budget already and stays itself)."""
        if (self.unlisted_users == "shared" and user not in self.user_rates
                and user != ANONYMOUS_USER):
            return UNLISTED_USER
        return user

    def same_limits(self, other: OutputRateConfig) -> bool:
        return self._limits_dict() == other._limits_dict() and (
            self.unlisted_users == other.unlisted_users)


def _unlisted_mode(value: Any) -> str:
    if value not in UNLISTED_MODES:
        raise OutputRateConfigError(
            f"{UNLISTED_OPTION}: expected one of {', '.join(UNLISTED_MODES)}, got {value!r}"
        )
    return str(value)


def _digest_of(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


# -- between processes ------------------------------------------------------------

#: serialised form (``to_dict``, as JSON) -> the object it was made from or
#: read as, in this process: the front end parses the options once, and
#: ``config_of`` finds that object again instead of parsing its serialisation
_KNOWN: dict[str, OutputRateConfig] = {}
_KNOWN_MAX = 16


def _remember(key: str, config: OutputRateConfig) -> OutputRateConfig:
    if len(_KNOWN) >= _KNOWN_MAX:
        _KNOWN.clear()
    _KNOWN[key] = config
    return config


def to_wire(config: OutputRateConfig) -> dict[str, Any]:
    """What crosses into the engine core (``additional_config``, and the
    environment of spawned API servers): ``config.to_dict()``, remembered so
    that ``config_of`` in this process returns ``config`` itself."""
    data = config.to_dict()
    _remember(json.dumps(data, sort_keys=True, default=str), config)
    return data


def config_of(vllm_config: Any) -> OutputRateConfig | None:
    """The limits carried in ``additional_config``, or None (feature off):
    the one reader of the serialised form. In the process that parsed the
    options, the object it parsed; elsewhere (the engine core, or the
    Python API's own ``additional_config``) read once with ``from_dict``."""
    extra = getattr(vllm_config, "additional_config", None) or {}
    data = extra.get(ADDITIONAL_CONFIG_KEY)
    if data is None:
        return None
    key = json.dumps(data, sort_keys=True, default=str)
    config = _KNOWN.get(key)
    return config if config is not None else _remember(key, OutputRateConfig.from_dict(data))


# -- the limits file ------------------------------------------------------------

def read_limits_file(path: str) -> bytes:
    """The file's bytes; a clear error when it cannot be read."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise OutputRateConfigError(
            f"{LIMITS_FILE_OPTION} {path}: cannot read it ({exc.strerror or exc})"
        ) from None


def load_limits_file(path: str) -> OutputRateConfig:
    """Read and check a limits file (YAML or JSON) at start-up: every error
    names the option too (a reload, ``parse_limits_document``, names the
    file)."""
    path = os.path.abspath(path)
    content = read_limits_file(path)  # its errors name the option already
    try:
        return parse_limits_document(content, path)
    except ConfigFileError as exc:
        raise ConfigFileError([f"{LIMITS_FILE_OPTION} {e}" for e in exc.errors]) from None


def parse_limits_document(content: bytes, path: str) -> OutputRateConfig:
    """A limits file's content, checked (``vllm_output_rate.limits_file``):
    the one parser of the engine's start-up, its reloads and
    ``vllm-output-rate check-limits``. Raises ``ConfigFileError`` naming
    every error found, each with the file, the line, the key and the value."""
    from vllm_output_rate.limits_file import parse_document

    try:
        return OutputRateConfig(**parse_document(content, path), limits_file=path,
                                digest=hashlib.sha256(content).hexdigest())
    except ConfigFileError:
        raise
    except OutputRateConfigError as exc:
        raise ConfigFileError([f"{path}: {exc}"]) from None
