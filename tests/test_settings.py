"""The one table of the project's environment variables."""

from __future__ import annotations

import logging
import re

import pytest

from harness import REPO
from vllm_output_rate import settings

SOURCE_DIRS = ("vllm_patch", "telemetry", "tracing", "dashboards", "scripts")
NOT_OURS = {"OUTPUT_RATE_PROMETHEUS_UID"}  # Grafana's (see settings' docstring)


def _sources():
    for folder in SOURCE_DIRS:
        for path in (REPO / folder).rglob("*"):
            if path.suffix in (".py", ".sh", ".yaml") and path.is_file():
                yield path


def test_every_variable_the_code_names_is_in_the_table():
    names = {s.name for s in settings.SETTINGS}
    seen = set()
    for path in _sources():
        for name in re.findall(r"\b(?:VLLM_)?OUTPUT_RATE_[A-Z0-9_]+\b", path.read_text()):
            if name in NOT_OURS or name == "OUTPUT_RATE_":
                continue
            assert name in names, f"{path.relative_to(REPO)} names {name}, not in settings.SETTINGS"
            seen.add(name)
    assert seen  # the scan found the names it checks


def test_only_the_settings_module_reads_the_environment_for_them():
    for path in _sources():
        if path.suffix != ".py" or path.name == "settings.py":
            continue
        for line in path.read_text().splitlines():
            if "environ" in line and ("OUTPUT_RATE" in line or "_ENV" in line.split("environ")[1][:40]):
                pytest.fail(f"{path.relative_to(REPO)} reads a project variable itself: {line.strip()}")


def test_vllm_does_not_warn_about_them(monkeypatch):
    """vLLM's own check (the one that logs 'Unknown vLLM environment
    variable detected') passes with every variable of ours set."""
    from vllm.platforms.interface import Platform

    for setting in settings.SETTINGS:
        monkeypatch.setenv(setting.name, "1")
    Platform.validate_environ(hard_fail=True)
    monkeypatch.setenv("VLLM_OUTPUT_RATE_TELEMETRY", "0")  # the old name: vLLM's
    with pytest.raises(ValueError, match="VLLM_OUTPUT_RATE_TELEMETRY"):
        Platform.validate_environ(hard_fail=True)


@pytest.mark.parametrize("key, raw", [("TOP_K_USERS", "many"), ("TOP_K_USERS", "-1"),
                                      ("TRACE_REFUSAL_STEP_EVERY", "0"), ("TELEMETRY", "maybe"),
                                      ("TRACE_THROTTLE_MIN_S", "nan"), ("TRACE_THROTTLE_MIN_S", "-2")])
def test_a_bad_value_names_the_variable_and_the_value(key, raw, caplog):
    env = {settings.name(key): raw}
    with pytest.raises(settings.SettingError, match=rf"{settings.name(key)}='{re.escape(raw)}'"):
        settings.get(key, env)
    with caplog.at_level(logging.WARNING, logger="vllm_output_rate"):
        assert settings.get_or_default(key, env) == settings.BY_KEY[key].default
    assert settings.name(key) in caplog.text


def test_values_parse_and_child_env_round_trips():
    env = settings.child_env(TELEMETRY=False, TOP_K_USERS=7, EVENTS="/x/events.jsonl",
                             TRACE_THROTTLE_MIN_S=0.5)
    assert env == {"OUTPUT_RATE_TELEMETRY": "0", "OUTPUT_RATE_TOP_K_USERS": "7",
                   "OUTPUT_RATE_EVENTS": "/x/events.jsonl", "OUTPUT_RATE_TRACE_THROTTLE_MIN_S": "0.5"}
    assert settings.get("TELEMETRY", env) is False
    assert settings.get("TOP_K_USERS", env) == 7
    assert settings.get("EVENTS", env) == "/x/events.jsonl"
    assert settings.get("TRACE_THROTTLE_MIN_S", env) == 0.5
    assert settings.get("TELEMETRY", {}) is True  # defaults when unset


def test_old_names_are_reported_once(caplog):
    settings._legacy_warned = False
    env = {"VLLM_OUTPUT_RATE_TELEMETRY": "0"}
    with caplog.at_level(logging.WARNING, logger="vllm_output_rate"):
        assert settings.check_legacy_names(env) == ["VLLM_OUTPUT_RATE_TELEMETRY"]
        settings.check_legacy_names(env)
    assert caplog.text.count("not read") == 1 and "OUTPUT_RATE_TELEMETRY" in caplog.text


@pytest.mark.parametrize("environ, endpoint, on", [
    ({}, None, False),
    ({}, "http://collector:4317", True),  # vLLM's --otlp-traces-endpoint
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, None, True),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}, None, True),
    ({"OTEL_TRACES_EXPORTER": "console"}, None, True),
    ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, None, False),
    ({"OTEL_TRACES_EXPORTER": "otlp, none"}, "http://c:4317", False),
    ({"OUTPUT_RATE_TRACES_FILE": "/tmp/spans.jsonl"}, None, True),
    ({"OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "http://c:4318"}, None, False),  # metrics only
])
def test_traces_are_on_by_one_rule(environ, endpoint, on):
    assert settings.traces_requested(endpoint, environ) is on
