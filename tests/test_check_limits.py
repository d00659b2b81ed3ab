"""``vllm-output-rate check-limits``: the engine's own parsers run offline
(exit 0 when valid, 1 naming each error's file, line, key and value), the
limits file's JSON Schema agreeing with the parser, and a key given twice
refused in every file the project reads, naming both lines."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from fractions import Fraction

import jsonschema
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness import REPO
from vllm_output_rate.config import ConfigFileError, load_limits_file, parse_limits_document
from vllm_output_rate.frontend import key_digest, parse_api_keys
from vllm_output_rate.limits_file import LIMITS_FILE_KEYS, PAIR_KEYS, schema
from vllm_output_rate.limits_watch import LimitsWatcher
from vllm_output_rate.tools import check_limits
from vllm_output_rate.yaml_load import DuplicateKeyError, load_json, load_yaml, safe_load

GOOD = """\
default: 5
tiers:
  gold: {rate: 200, ceiling: 800}
  free: 1/3
users:
  alice: gold
  bob: 12.5
  carol: {rate: 10, ceiling: unlimited}
  42: free
"""

#: every line of this file holds one error: (line, key path, value as shown)
BAD = """\
default: 0
tiers:
  gold: 100
  silver: -3
  gold: 200
users:
  alice: 5
  bob: silver
  carol: platinum
  dave: {rate: 10, ceiling: 5}
  erin: .inf
  alice: 7
  frank: {rate: 5, ceil: 9}
limits: {}
"""
BAD_ERRORS = [
    (1, "default", "0"),
    (4, "tiers.silver", "-3"),
    (5, "tiers.gold", "(200)"),  # and the first: line 3 (100)
    (9, "users.carol", "'platinum'"),
    (10, "users.dave", "ceiling 5"),
    (11, "users.erin", "inf"),
    (12, "users.alice", "(7)"),
    (13, "users.frank", "'ceil': 9"),
    (14, "limits", "'limits'"),
]


def run_command(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vllm_output_rate.tools.cli", "check-limits", *args],
                          capture_output=True, text=True, timeout=60, cwd=REPO)


def keys_file(path, entries: str):
    path.write_text("keys:\n" + entries)
    return str(path)


# -- the command -------------------------------------------------------------------


def test_the_command_passes_a_good_file_and_fails_a_bad_one_naming_each_error(tmp_path):
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text(GOOD)
    bad.write_text(BAD)
    ok = run_command(str(good))
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.strip() == f"{good}: valid (default 5 tok/s, 2 tier(s), 4 user(s), borrowing)"
    failed = run_command(str(good), str(bad))
    assert failed.returncode == 1
    errors = failed.stderr.strip().splitlines()
    assert len(errors) == len(BAD_ERRORS), errors
    for error, (line, key, value) in zip(errors, BAD_ERRORS):
        assert error.startswith(f"{bad}:{line}: {key}: ") and value in error, (error, line, key)
    assert "at line 3 (100) and again at line 5 (200)" in errors[2]
    assert "at line 7 (5) and again at line 12 (7)" in errors[6]
    assert f"{good}: valid" in failed.stdout  # the good one still said so


def test_usage_errors_exit_2_and_an_unreadable_file_1(tmp_path, capsys):
    assert run_command().returncode == 2
    missing = tmp_path / "missing.yaml"
    assert check_limits.main([str(missing)]) == 1
    assert capsys.readouterr().err == f"{missing}: cannot read it (No such file or directory)\n"


def test_the_checks_are_the_engines(tmp_path):
    """check-limits, the engine's start-up and a running engine's reload say
    the same errors of the same file."""
    path = tmp_path / "limits.yaml"
    path.write_text("default: 5\n")
    watcher = LimitsWatcher(load_limits_file(str(path)), start_thread=False)
    path.write_text(BAD)
    assert watcher.check() == "invalid"
    errors, valid = check_limits.check([str(path)], [], [])
    assert valid == [] and watcher.last_error.splitlines() == errors
    with pytest.raises(ConfigFileError) as err:
        load_limits_file(str(path))
    assert err.value.errors == [f"--output-rate-limits-file {e}" for e in errors]
    path.write_text(GOOD)
    assert watcher.check() == "loaded"
    assert check_limits.check([str(path)], [], []) == ([], [f"{path}: valid (default 5 tok/s, "
                                                              "2 tier(s), 4 user(s), borrowing)"])


@pytest.mark.parametrize("text, line, key, value", [
    ("default: 5\nusers:\n  bob: yes\n", 3, "users.bob", "True"),
    ("default: 5\ntiers:\n  gold:\n    rate: 5\n    ceiling: lots\n", 5, "tiers.gold.ceiling", "'lots'"),
    ("default: 5\ntiers:\n  gold:\n    rate: x\n", 4, "tiers.gold.rate", "'x'"),
    ("default: 5\nusers: [1]\n", 2, "users", "[1]"),
    ('{"default": 5,\n "users": {"a": -1}}\n', 2, "users.a", "-1"),
    ("users: {a: 1}\n", 1, "'default' is required", ""),
    ("default: [5\n", 2, "not valid YAML", ""),
])
def test_each_error_names_the_file_the_line_the_key_and_the_value(tmp_path, text, line, key, value):
    path = tmp_path / "limits.yaml"
    path.write_text(text)
    errors, _ = check_limits.check([str(path)], [], [])
    assert len(errors) == 1 and errors[0].startswith(f"{path}:{line}: {key}"), errors
    assert value in errors[0]


def test_keys_files_are_checked_never_showing_a_key(tmp_path, capsys):
    good = keys_file(tmp_path / "api.yaml", f"  {key_digest('k1')}: alice\n  {key_digest('k2')}: bob\n")
    admin = keys_file(tmp_path / "admin.yaml", f"  {key_digest('ops')}: ops\n")
    assert check_limits.main(["--api-keys", good, "--admin-keys", admin]) == 0
    assert capsys.readouterr().out.splitlines() == [f"{good}: valid (API keys: 2)",
                                                    f"{admin}: valid (admin keys: 1)"]
    digest = key_digest("k1")
    bad = keys_file(tmp_path / "bad.yaml", f"  {digest}: alice\n  plain-secret-key: bob\n"
                                           f"  {key_digest('k3')}: ''\n  {digest}: carol\n")
    assert check_limits.main(["--admin-keys", admin, "--api-keys", bad]) == 1
    errors = capsys.readouterr().err.splitlines()
    assert errors == [
        f"{bad}:3: keys.plain-se...: not a SHA-256 hex digest (64 hex digits); the file holds "
        "digests of keys, never keys",
        f"{bad}:4: keys.{key_digest('k3')[:8]}...: expected a user id, got ''",
        f"{bad}:5: keys.{digest[:8]}...: duplicate key '{digest[:8]}...' at line 2 (alice) "
        "and again at line 5 (carol)"]


def test_the_api_servers_refuse_a_keys_file_with_a_digest_twice():
    digest = key_digest("k1")
    text = f"keys:\n  {digest}: alice\n  {digest.upper()}: bob\n"
    with pytest.raises(ConfigFileError, match=r"keys.yaml:3: .*listed twice"):
        parse_api_keys(text.encode(), "keys.yaml")


# -- a key given twice, in every file --------------------------------------------------


def test_the_loader_names_both_lines_of_every_key_given_twice():
    text = "a: 1\nb:\n  c: 2\n  d: 3\n  c: 4\nlist:\n  - {x: 1, x: 2}\na: 5\n"
    doc = load_yaml(text, "f.yaml")
    assert [(d.keys, d.first, d.again) for d in doc.duplicates] == [
        (("b", "c"), 3, 5), (("list", 0, "x"), 7, 7), (("a",), 1, 8)]
    assert doc.line_of(("b", "d")) == 4 and doc.line_of(("b", "d", "deeper")) == 4
    assert doc.data == {"a": 5, "b": {"c": 4, "d": 3}, "list": [{"x": 2}]}
    with pytest.raises(DuplicateKeyError) as err:
        safe_load(text, "f.yaml")
    assert str(err.value).splitlines()[0] == "f.yaml:5: b.c: duplicate key 'c' at line 3 (2) and again at line 5 (4)"
    assert len(str(err.value).splitlines()) == 3
    # a merge key's override and a recursive alias are no duplicates
    assert safe_load("base: &b {x: 1}\nthis:\n  <<: *b\n  x: 2\n", "f") == {
        "base": {"x": 1}, "this": {"x": 2}}
    assert safe_load("a: &r [*r]\n", "f")["a"][0] is not None
    with pytest.raises(DuplicateKeyError, match=r"f.json:3: a: duplicate key 'a' at line 2 \(1\)"):
        load_json('{\n "a": 1,\n "a": 2}', "f.json")
    assert load_json('{"a": 1}', "f.json") == {"a": 1}


def test_a_limits_file_with_a_key_twice_is_refused_yaml_and_json(tmp_path):
    for name, text in [("l.yaml", "default: 5\nusers:\n  alice: 5\n  alice: 7\n"),
                       ("l.json", '{"default": 5,\n "users": {"alice": 5,\n  "alice": 7}}\n')]:
        path = tmp_path / name
        path.write_text(text)
        with pytest.raises(ConfigFileError) as err:
            parse_limits_document(path.read_bytes(), str(path))
        assert err.value.errors == [f"{path}:4: users.alice: duplicate key 'alice' at line 3 (5) "
                                    "and again at line 4 (7)"] if name == "l.yaml" else [
            f"{path}:3: users.alice: duplicate key 'alice' at line 2 (5) and again at line 3 (7)"]


def test_a_scenario_with_a_key_twice_is_refused(tmp_path):
    from vllm_output_rate.tools.loadgen.scenario import (
        DEFAULT_SCENARIO,
        ScenarioError,
        load_scenario,
    )

    text = DEFAULT_SCENARIO.read_text()
    first = next(i for i, line in enumerate(text.splitlines(), 1) if line.startswith("name:"))
    path = tmp_path / "s.yaml"
    path.write_text(text + "name: again\n")
    with pytest.raises(ScenarioError) as err:
        load_scenario(path)
    last = len(text.splitlines()) + 1
    assert str(err.value) == (f"{path}:{last}: name: duplicate key 'name' at line {first} "
                              f"({yaml.safe_load(text)['name']}) and again at line {last} (again)")
    data = json.dumps(yaml.safe_load(text), indent=1)
    as_json = tmp_path / "s.json"
    as_json.write_text(data[:-1] + ',\n "timeout_s": 5\n}')
    with pytest.raises(ScenarioError, match=r"s.json:\d+: timeout_s: duplicate key 'timeout_s' "
                                            r"at line \d+ \(300\) and again at line \d+ \(5\)$"):
        load_scenario(as_json)


def test_a_workload_line_with_a_field_twice_is_refused(tmp_path):
    from vllm_output_rate.tools.twin.workload import WorkloadError, read_workload

    path = tmp_path / "w.jsonl"
    path.write_text('{"t": 0, "user": "a", "prompt_tokens": 4, "max_tokens": 8}\n'
                    '{"t": 1, "user": "a", "user": "b", "prompt_tokens": 4, "max_tokens": 8}\n')
    with pytest.raises(WorkloadError, match=rf"^{path}:2: user: duplicate key 'user' twice on "
                                            r"line 2 \('a'\) and \('b'\)$"):
        read_workload(str(path))


def test_the_thresholds_file_with_a_key_twice_is_refused(tmp_path):
    from vllm_output_rate.dashboards import thresholds

    text = thresholds.HERE.joinpath("thresholds.yaml").read_text()
    assert thresholds.load_thresholds(thresholds.HERE / "thresholds.yaml")
    top = next(line.split(":")[0] for line in text.splitlines() if line and line[0].isalpha())
    path = tmp_path / "thresholds.yaml"
    path.write_text(text + f"{top}: {{}}\n")
    with pytest.raises(DuplicateKeyError, match=rf"thresholds.yaml:{len(text.splitlines()) + 1}: "
                                                rf"{top}: duplicate key '{top}' at line \d+"):
        thresholds.load_thresholds(path)


# -- the JSON Schema -----------------------------------------------------------------


def test_the_schema_prints_as_valid_json_schema_with_the_parsers_keys(capsys):
    assert check_limits.main(["--schema"]) == 0
    printed = json.loads(capsys.readouterr().out)
    jsonschema.Draft202012Validator.check_schema(printed)
    assert printed == schema()
    assert tuple(printed["properties"]) == LIMITS_FILE_KEYS
    assert printed["required"] == ["default"]
    pair = printed["$defs"]["limit"]["anyOf"][1]
    assert tuple(pair["properties"]) == PAIR_KEYS and pair["required"] == ["rate"]
    assert (REPO / "docs" / "limits.schema.json").read_text() == json.dumps(printed, indent=2) + "\n"


VALIDATOR = jsonschema.Draft202012Validator(schema())


def schema_accepts(text: str) -> bool:
    """What an editor validating the file against the schema says (it sees
    the document as JSON: keys as strings)."""
    data = json.loads(json.dumps(yaml.safe_load(text), default=str))
    return VALIDATOR.is_valid(data)


def parser_accepts(text: str) -> bool:
    try:
        parse_limits_document(text.encode(), "limits.yaml")
    except ConfigFileError:
        return False
    return True


@pytest.mark.parametrize("text, valid", [
    (GOOD, True),
    ("default: 5\n", True),
    ("default: '0.5'\nusers: null\ntiers: []\n", True),
    ("default: 1000000000\n", True),
    ("default: {rate: 5, ceiling: UNLIMITED}\n", True),
    ("default: {rate: 5, ceiling: null}\n", True),
    ("default: {rate: 100, prompt_rate: 20000}\ntiers: {free: {rate: 5, prompt_rate: 500}}\n"
     "users: {rag-co: {rate: 50, prompt_rate: 4000}, b: free, c: {rate: 1, prompt_rate: unlimited}}\n",
     True),
    ("default: {rate: 5, prompt_rate: null}\n", True),
    ("default: {rate: 5, prompt_rate: 0}\n", False),
    ("default: {rate: 5, prompt_rate: lots}\n", False),
    ("default: {prompt_rate: 500}\n", False),
    ("default: 1000000001\n", False),
    ("default: 0\n", False),
    ("default: -1\n", False),
    ("default: yes\n", False),
    ("default: abc\n", False),
    ("default: '1.5/3'\n", False),
    ("default: [5]\n", False),
    ("default: null\n", False),
    ("users: {a: 5}\n", False),
    ("default: 5\nlimits: {}\n", False),
    ("default: {rate: 5, ceil: 9}\n", False),
    ("default: {ceiling: 9}\n", False),
    ("default: 5\ntiers: {gold: lots}\n", False),
    ("default: 5\nusers: {a: [5]}\n", False),
    ("default: 5\nusers: {a: ''}\n", False),
    (f"default: 5\nusers: {{{'u' * 257}: 5}}\n", False),
    ("default: 5\nusers: 7\n", False),
    ("- 5\n", False),
])
def test_the_schema_and_the_parser_agree(text, valid):
    assert schema_accepts(text) == valid and parser_accepts(text) == valid, text


@pytest.mark.parametrize("text", [
    "default: '0'\n",  # a number as a string: its size is the parser's to check
    "default: .nan\n",  # YAML's NaN: a JSON Schema number cannot refuse it
    "default: 5\nusers: {a: platinum}\n",  # a tier the file does not have
    "default: {rate: 5, ceiling: 2}\n",  # a ceiling below its rate
])
def test_what_only_the_parser_checks(text):
    """The schema's documented limits: it passes these, the parser refuses."""
    assert schema_accepts(text) and not parser_accepts(text)


_NUMBERS = st.one_of(
    st.integers(-5, 2 * 10**9), st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([10**9, 10**9 + 1, 0, 1e-300, 0.1]))
_STRINGS = st.one_of(
    st.from_regex(r"\A[ +\-]?[0-9]{1,4}(\.[0-9]{0,3})?(e-?[0-9])?( ?/ ?[1-9])?\Z"),
    st.sampled_from(["unlimited", " Unlimited ", "lots", "", "1.5/3", "1e", "x"]))
_SCALARS = st.one_of(_NUMBERS, _STRINGS, st.booleans(), st.none(), st.just([5]))
_LIMITS = st.one_of(_SCALARS, st.fixed_dictionaries(
    {"rate": _SCALARS}, optional={"ceiling": _SCALARS, "ceil": _SCALARS,
                                  "prompt_rate": _SCALARS}))
_NAMES = st.sampled_from(["gold", "free", "a", "42"])


@st.composite
def documents(draw) -> dict:
    doc = {} if draw(st.integers(0, 9)) == 0 else {"default": draw(_LIMITS)}
    if draw(st.booleans()):
        doc["tiers"] = draw(st.dictionaries(_NAMES, _LIMITS, max_size=3))
    if draw(st.booleans()):
        values = st.one_of(_LIMITS, st.sampled_from(sorted(doc.get("tiers", {})) or ["gold"]))
        doc["users"] = draw(st.dictionaries(st.sampled_from(["alice", "bob", 7]), values, max_size=3))
    return doc


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(documents())
def test_a_file_the_parser_accepts_the_schema_accepts(doc):
    """No valid file is flagged by an editor using the schema; and every
    file the schema refuses, the parser refuses."""
    text = yaml.safe_dump(doc)
    if parser_accepts(text):
        assert schema_accepts(text), text


def _gap(value) -> bool:
    """A value whose fault only the parser sees: a number written as a
    string (its size), a ceiling below its rate, a user naming no tier."""
    if isinstance(value, dict):
        return any(_gap(v) for v in value.values()) or _below(value)
    if isinstance(value, float):
        return math.isnan(value)  # (a JSON Schema number cannot refuse NaN)
    return isinstance(value, str) and value.strip().lower() != "unlimited"


def _below(pair: dict) -> bool:
    rate, ceiling = pair.get("rate"), pair.get("ceiling")
    try:
        return Fraction(repr(ceiling)) < Fraction(repr(rate))
    except (TypeError, ValueError, ZeroDivisionError, OverflowError):
        return False


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(documents())
def test_the_schema_and_the_parser_agree_where_the_schema_can_say(doc):
    tiers = doc.get("tiers", {})
    values = [doc.get("default"), *tiers.values(),
              *(v for v in doc.get("users", {}).values() if not (isinstance(v, str) and v in tiers))]
    # a user's value as a string names a tier: one the file lacks is the
    # parser's to see ("unlimited" too: it is a ceiling, not a limit)
    if any(_gap(v) for v in values) or any(
            isinstance(v, str) and v not in tiers for v in doc.get("users", {}).values()):
        return
    text = yaml.safe_dump(doc)
    assert schema_accepts(text) == parser_accepts(text), text
