"""The fault and bad-input runner (``vllm-output-rate stress``): its config
table in-process, and its quick profile against a real CPU engine."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from harness import second_model, tiny_model
from vllm_output_rate.config import DEFAULT_OPTION
from vllm_output_rate.tools.reliability import config_cases, stress


def test_the_config_table_covers_every_option():
    cc = config_cases
    assert len(cc.CONFIG_CASES) >= 20
    options = {a for case in cc.CONFIG_CASES for a in case.args if a.startswith("--")}
    for option in (cc.DEFAULT_OPTION, cc.USERS_OPTION, cc.LIMITS_FILE_OPTION, cc.UNLISTED_OPTION,
                   cc.SHARED_STATE_OPTION, cc.HEADER_OPTION, cc.REQUIRE_OPTION, cc.API_KEYS_OPTION,
                   cc.ADMIN_KEYS_OPTION, cc.INTROSPECTION_OPTION, cc.LABEL_OPTION, cc.SALT_OPTION):
        assert option in options, option


@pytest.mark.parametrize("case", config_cases.CONFIG_CASES, ids=lambda c: c.name)
def test_every_bad_value_is_refused_naming_option_and_value(case, tmp_path):
    result = config_cases.check_config_case(case, tiny_model(), tmp_path)
    assert result.ok, result


def test_a_good_configuration_is_a_failed_case(tmp_path):
    """The check can fail: a configuration that is accepted is reported."""
    good = config_cases.ConfigCase("good", (DEFAULT_OPTION, "5"), (DEFAULT_OPTION,))
    result = config_cases.check_config_case(good, tiny_model(), tmp_path)
    assert not result.ok and result.measured == "accepted"


def test_a_refusal_that_does_not_name_the_value_is_a_failed_case(tmp_path):
    vague = config_cases.ConfigCase("vague", (DEFAULT_OPTION, "0"),
                                    (DEFAULT_OPTION, "a value it never names"))
    assert not config_cases.check_config_case(vague, tiny_model(), tmp_path).ok


@pytest.mark.e2e
@pytest.mark.parametrize("model", ["tiny", pytest.param("second", marks=pytest.mark.long)])
def test_quick_profile_against_a_real_engine(tmp_path, model):
    """On the demo's model, every group of the quick profile; on a second
    one with another tokenizer and shape, the groups whose requests depend
    on the model (prompt sizes are in that model's tokens; the refused
    configurations, identity churn and client faults do not): that one in
    `make test-all` (marker ``long``; `make test` tries the second model
    with verify, the demo, the load generator and the profiler)."""
    out = tmp_path / "report"
    path = tiny_model() if model == "tiny" else second_model()
    want = ({"config", "identity_churn", "user_field", "requests", "client_faults"}
            if model == "tiny" else {"user_field", "requests"})
    code = stress.main(["--model", path, "--profile", "quick", "--out", str(out),
                        "--groups", ",".join(sorted(want))])
    doc = json.loads((out / "report.json").read_text())
    failed = [c for c in doc["cases"] if not c["ok"]]
    assert code == 0 and failed == [], failed
    groups = {c["group"] for c in doc["cases"]}
    assert groups == want
    names = {c["name"] for c in doc["cases"]}
    assert {"n > 1", "beam search", "prompt longer than the model"} <= names
    if model == "tiny":
        assert "slow consumers" in names
    markdown = (out / "report.md").read_text()
    assert f"{len(doc['cases'])} passed, 0 failed." in markdown


@pytest.mark.e2e
def test_a_real_server_refuses_a_bad_file_in_one_line(tmp_path):
    """``vllm-output-rate serve`` itself: exit 2, one error line naming the
    option, the file, the key path and the value; no traceback."""
    case = next(c for c in config_cases.CONFIG_CASES if c.name == "limits file unknown tier")
    result = config_cases.serve_refuses(case, tiny_model(), tmp_path, tmp_path)
    assert result.ok, result
    assert "error: --output-rate-limits-file" in result.measured


@pytest.mark.parametrize("progress", [True, False], ids=["progress", "no-progress"])
def test_a_line_per_group_and_case_on_stderr_unless_no_progress(tmp_path, capsys, progress):
    """The config group (parsed in-process, no engine): a line as the group
    starts and one per case, on stderr; none with --no-progress. The report
    on stdout either way."""
    argv = ["--model", tiny_model(), "--groups", "config", "--out", str(tmp_path)]
    code = stress.main(argv + ([] if progress else ["--no-progress"]))
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.startswith("stress: ")]
    assert code == 0
    if not progress:
        assert lines == []
    else:
        n = len(config_cases.CONFIG_CASES)
        assert len(lines) == 1 + n and f"config: {n} refused configurations" in lines[0]
        for i, (line, case) in enumerate(zip(lines[1:], config_cases.CONFIG_CASES), 1):
            assert f" {i} cases (0 failed): pass config: {case.name} (" in line, line
    assert f"{len(config_cases.CONFIG_CASES)} passed, 0 failed" in out


def test_a_bad_limits_file_is_refused_before_vllm_is_imported(tmp_path):
    """The limits options are checked before vLLM's imports (about ten
    seconds of them): the refusal names the file's line, and vLLM was never
    imported; a good file goes on to vLLM's own parser."""
    bad = tmp_path / "limits.yaml"
    bad.write_text("default: 5\nusers:\n  a: nosuchtier\n")
    probe = ("import sys\nfrom vllm_output_rate.tools import cli\n"
             "try:\n    cli.main(sys.argv[1:])\nexcept SystemExit as exc:\n"
             "    print('exit', exc.code, 'vllm' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", probe, "serve", tiny_model(), "--max-model-len", "256",
                           "--output-rate-limits-file", str(bad)],
                          capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "exit 2 False", (proc.stdout, proc.stderr[-2000:])
    assert f"error: --output-rate-limits-file {bad}:3: users.a:" in proc.stderr
