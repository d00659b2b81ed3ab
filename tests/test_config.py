"""Option parsing: good values are exact, bad ones name the option and value."""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_output_rate.config import (
    ANONYMOUS_USER,
    DEFAULT_OPTION,
    MAX_USER_LEN,
    USERS_OPTION,
    OutputRateConfig,
    OutputRateConfigError,
    parse_rate,
    parse_user_rates,
)
from vllm_output_rate.request_fields import resolve_user


@pytest.mark.parametrize(
    "text, expected",
    [("20", Fraction(20)), ("0.5", Fraction(1, 2)), (" 1e2 ", Fraction(100)),
     (0.1, Fraction(1, 10)), (3, Fraction(3)), ("33.3", Fraction(333, 10))],
)
def test_good_rates_are_exact(text, expected):
    assert parse_rate(text, DEFAULT_OPTION) == expected


@pytest.mark.parametrize(
    "bad", ["0", "-1", "nan", "NaN", "inf", "-inf", "abc", "", "1/0", True, None, [1], "1e10"]
)
def test_bad_default_names_option_and_value(bad):
    with pytest.raises(OutputRateConfigError) as err:
        OutputRateConfig.from_options(bad if bad is not None else [None])
    assert DEFAULT_OPTION in str(err.value)
    assert repr(bad if bad is not None else [None]) in str(err.value)


@pytest.mark.parametrize(
    "bad, fragment",
    [
        ("[1, 2]", "JSON object"),
        ('{"a": 0}', "'a'"),
        ('{"a": -3}', "-3"),
        ('{"a": NaN}', "NaN"),
        ('{"a": Infinity}', "Infinity"),
        ('{"a": "fast"}', "fast"),
        ('{"a": null}', "None"),
        ('{"a": true}', "True"),
        ('{"": 5}', "non-empty"),
        ("{not json", "JSON object"),
        ('"20"', "JSON object"),
    ],
)
def test_bad_user_json_is_refused(bad, fragment):
    with pytest.raises(OutputRateConfigError) as err:
        OutputRateConfig.from_options("10", bad)
    assert USERS_OPTION in str(err.value)
    assert fragment in str(err.value)


def test_overrides_without_default_are_refused():
    with pytest.raises(OutputRateConfigError, match=DEFAULT_OPTION):
        OutputRateConfig.from_options(None, '{"a": 5}')


def test_feature_off_without_default():
    assert OutputRateConfig.from_options(None, None) is None


def test_round_trip_through_additional_config_is_exact():
    cfg = OutputRateConfig.from_options("0.5", '{"a": 100, "b": 0.1, "c": "2.25"}')
    again = OutputRateConfig.from_dict(cfg.to_dict())
    assert again == cfg
    assert again.user_rates == {"a": 100, "b": Fraction(1, 10), "c": Fraction(9, 4)}


def test_from_dict_refuses_unknown_keys_and_missing_default():
    with pytest.raises(OutputRateConfigError, match="unknown keys"):
        OutputRateConfig.from_dict({"default_user_output_tokens_per_second": 1, "burst": 2})
    with pytest.raises(OutputRateConfigError, match="required"):
        OutputRateConfig.from_dict({"user_output_tokens_per_second": {}})


@given(st.dictionaries(st.text(min_size=1, max_size=20),
                       st.integers(1, 10**6) | st.floats(0.001, 1e6)))
def test_any_valid_object_parses(obj):
    rates = parse_user_rates(obj)
    assert set(rates) == set(obj)
    assert all(r > 0 for r in rates.values())


@pytest.mark.parametrize(
    "extra, user",
    [(None, ANONYMOUS_USER), ({}, ANONYMOUS_USER), ({"output_rate_user": ""}, ANONYMOUS_USER),
     ({"output_rate_user": None}, ANONYMOUS_USER), ({"output_rate_user": "u1"}, "u1"),
     ({"output_rate_user": 42}, "42"), ({"output_rate_user": {"x": 1}}, ANONYMOUS_USER),
     ({"output_rate_user": ["a"]}, ANONYMOUS_USER), ({"output_rate_user": "x" * 1000}, "x" * MAX_USER_LEN),
     ({"user": "ignored"}, ANONYMOUS_USER)],
)
def test_resolve_user(extra, user):
    assert resolve_user(extra) == user


_FIELD_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=300),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=5,
)


@given(_FIELD_VALUES)
def test_one_rule_for_the_user_field(value):
    """What the serving entry refuses (HTTP 400) and what the engine
    resolves are the same rule: a value the entry lets through resolves to
    the user it names; a refused one never reaches the engine, and would be
    the anonymous user there."""
    from vllm_output_rate.config import USER_FIELD
    from vllm_output_rate.request_fields import user_field_error, user_of_field

    error = user_field_error({USER_FIELD: value})
    if error is None:
        assert resolve_user({USER_FIELD: value}) == user_of_field(value)
        assert 0 < len(resolve_user({USER_FIELD: value})) <= MAX_USER_LEN
    else:
        assert USER_FIELD in error and type(value).__name__ in error
        assert isinstance(value, (bool, list, dict))
        assert resolve_user({USER_FIELD: value}) == ANONYMOUS_USER


def test_carried_trace_headers_are_read_only_when_well_formed():
    from vllm_output_rate.config import TRACEPARENT_FIELD, TRACESTATE_FIELD
    from vllm_output_rate.request_fields import carried_trace_headers

    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    assert carried_trace_headers({TRACEPARENT_FIELD: parent}) == {"traceparent": parent}
    assert carried_trace_headers({TRACEPARENT_FIELD: parent, TRACESTATE_FIELD: "a=1"}) == {
        "traceparent": parent, "tracestate": "a=1"}
    for bad in (None, {}, {TRACEPARENT_FIELD: ""}, {TRACEPARENT_FIELD: 5},
                {TRACESTATE_FIELD: "a=1"}, ["not", "a", "dict"]):
        assert carried_trace_headers(bad) is None


PROMPT_FILE = b"""\
default: {rate: 100, prompt_rate: 20000}
tiers: {free: {rate: 5, prompt_rate: 500}, plain: 7}
users:
  rag-co: {rate: 50, prompt_rate: 4000}
  bob: free
  carol: plain
  alice: 10
  eve: {rate: 3, prompt_rate: unlimited}
"""


def test_a_users_prompt_budget_is_its_own_its_tiers_or_the_defaults():
    from vllm_output_rate.config import parse_limits_document

    config = parse_limits_document(PROMPT_FILE, "limits.yaml")
    assert config.prompt_budgets
    assert {u: config.prompt_rate_of(u) for u in ("rag-co", "bob", "carol", "alice", "eve", "zed")} \
        == {"rag-co": 4000, "bob": 500, "carol": 20000, "alice": 20000, "eve": None, "zed": 20000}
    assert config.tier_prompt_rates == {"free": 500}
    again = OutputRateConfig.from_dict(config.to_dict())
    assert again.same_limits(config) and again.prompt_rate_of("bob") == 500
    # changing only a prompt budget is a change of limits (a reload applies it)
    other = parse_limits_document(PROMPT_FILE.replace(b"4000", b"4001"), "limits.yaml")
    assert not other.same_limits(config)


def test_the_prompt_option_needs_limits_and_is_not_beside_a_file():
    config = OutputRateConfig.from_options("20", default_prompt="0.5")
    assert config.prompt_rate_of("anyone") == Fraction(1, 2) and config.prompt_budgets
    assert OutputRateConfig.from_options("20").prompt_budgets is False
    assert OutputRateConfig.from_options("20", default_prompt="unlimited").prompt_rate_of("x") is None
    with pytest.raises(OutputRateConfigError, match="needs --output-rate-default-tokens-per-second"):
        OutputRateConfig.from_options(None, default_prompt="500")
    with pytest.raises(OutputRateConfigError, match="cannot be combined with --output-rate-limits-file"):
        OutputRateConfig.from_options(None, limits_file="x.yaml", default_prompt="500")
    with pytest.raises(OutputRateConfigError,
                       match=r"--output-rate-default-prompt-tokens-per-second: .*got '-1'"):
        OutputRateConfig.from_options("20", default_prompt="-1")


def test_prompt_budgets_are_taken_with_shared_budgets():
    from vllm_output_rate.prompt_budget import check_shared

    config = OutputRateConfig.from_options("20", shared_state="redis://127.0.0.1:6379/0",
                                           default_prompt="500")
    assert config.prompt_rate_of("anyone") == 500
    # an engine without chunked prefill cannot serve them (a prompt goes whole)
    assert check_shared(config, chunked=True) is None
    assert "need chunked prefill" in check_shared(config, chunked=False)
    assert check_shared(OutputRateConfig.from_options("20", default_prompt="500"), False) is None
