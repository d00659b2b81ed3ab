"""The ``config`` group: every bad value of every option, each refused at
start-up naming the option and the value, through the same parser and
checks as ``vllm-output-rate serve`` in this process (``check_config_case``)
and, in the full profile, by a real server that exits (``serve_refuses``)."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path


from vllm_output_rate.access import ADMIN_KEYS_OPTION, INTROSPECTION_OPTION
from vllm_output_rate.config import (
    DEFAULT_OPTION,
    LIMITS_FILE_OPTION,
    UNLISTED_OPTION,
    USERS_OPTION,
)
from vllm_output_rate.frontend import API_KEYS_OPTION, HEADER_OPTION, REQUIRE_OPTION
from vllm_output_rate.shared_settings import SHARED_STATE_OPTION
from vllm_output_rate.user_label import LABEL_OPTION, SALT_OPTION
from vllm_output_rate.tools.reliability.cases import MAX_MODEL_LEN, CaseResult


@dataclass(frozen=True)
class ConfigCase:
    name: str
    #: serve arguments after the model ({dir} is a scratch directory)
    args: tuple[str, ...]
    #: what the error must name (the option, the value or the file's key path)
    names: tuple[str, ...]
    #: files to write in the scratch directory first: name -> content
    files: tuple[tuple[str, str], ...] = ()


D, U, F = DEFAULT_OPTION, USERS_OPTION, LIMITS_FILE_OPTION


CONFIG_CASES: tuple[ConfigCase, ...] = (
    ConfigCase("default zero", (D, "0"), (D, "0")),
    ConfigCase("default negative", (D, "-5"), (D, "-5")),
    ConfigCase("default nan", (D, "nan"), (D, "nan")),
    ConfigCase("default inf", (D, "inf"), (D, "inf")),
    ConfigCase("default not a number", (D, "fast"), (D, "fast")),
    ConfigCase("default empty", (D, ""), (D,)),
    ConfigCase("default huge exponent", (D, "1e999"), (D, "1e999")),
    ConfigCase("overrides zero", (D, "10", U, '{"a": 0}'), (U, "a")),
    ConfigCase("overrides a list", (D, "10", U, "[1]"), (U,)),
    ConfigCase("overrides a string limit", (D, "10", U, '{"a": "x"}'), (U, "x")),
    ConfigCase("overrides not JSON", (D, "10", U, "{oops"), (U,)),
    ConfigCase("overrides without a default", (U, '{"a": 5}'), (U, D)),
    ConfigCase("limits file missing", (F, "{dir}/absent.yaml"), (F, "absent.yaml")),
    ConfigCase("limits file not YAML", (F, "{dir}/l.yaml"), (F, "l.yaml", "not valid YAML"),
               (("l.yaml", "default: [1, 2\n"),)),
    ConfigCase("limits file negative default", (F, "{dir}/l.yaml"), (F, "l.yaml", "default", "-1"),
               (("l.yaml", "default: -1\n"),)),
    ConfigCase("limits file unknown tier", (F, "{dir}/l.yaml"), (F, "l.yaml", "users.bob", "platinum"),
               (("l.yaml", "default: 5\ntiers: {gold: 100}\nusers: {bob: platinum}\n"),)),
    ConfigCase("limits file unknown key", (F, "{dir}/l.yaml"), (F, "l.yaml", "defualt"),
               (("l.yaml", "defualt: 5\n"),)),
    ConfigCase("limits file and default option", (F, "{dir}/l.yaml", D, "5"), (F, D),
               (("l.yaml", "default: 5\n"),)),
    ConfigCase("unlisted users mode", (D, "5", UNLISTED_OPTION, "everyone"), (UNLISTED_OPTION, "everyone")),
    ConfigCase("shared state not a redis URL", (D, "5", SHARED_STATE_OPTION, "http://127.0.0.1:6379"),
               (SHARED_STATE_OPTION, "http://127.0.0.1:6379")),
    ConfigCase("shared state without a port", (D, "5", SHARED_STATE_OPTION, "redis://127.0.0.1"),
               (SHARED_STATE_OPTION, "redis://127.0.0.1")),
    ConfigCase("shared state bad tick", (D, "5", SHARED_STATE_OPTION, "redis://127.0.0.1:6379?tick_ms=0"),
               (SHARED_STATE_OPTION, "tick_ms")),
    ConfigCase("user header not a header name", (D, "5", HEADER_OPTION, "X User"), (HEADER_OPTION, "X User")),
    ConfigCase("require user without a header", (D, "5", REQUIRE_OPTION), (REQUIRE_OPTION, HEADER_OPTION)),
    ConfigCase("identity options without limits", (HEADER_OPTION, "X-User-Id"), (HEADER_OPTION,)),
    ConfigCase("api keys file missing", (D, "5", API_KEYS_OPTION, "{dir}/absent-keys.yaml"),
               (API_KEYS_OPTION, "absent-keys.yaml")),
    ConfigCase("api keys file with a plain key", (D, "5", API_KEYS_OPTION, "{dir}/k.yaml"),
               (API_KEYS_OPTION, "k.yaml", "SHA-256"), (("k.yaml", "keys: {sk-plain-secret: alice}\n"),)),
    ConfigCase("admin keys file missing", (D, "5", ADMIN_KEYS_OPTION, "{dir}/absent-admin.yaml"),
               (ADMIN_KEYS_OPTION, "absent-admin.yaml")),
    ConfigCase("admin keys file with a plain key", (D, "5", ADMIN_KEYS_OPTION, "{dir}/a.yaml"),
               (ADMIN_KEYS_OPTION, "a.yaml", "SHA-256"), (("a.yaml", "keys: {ops-plain-secret: oncall}\n"),)),
    ConfigCase("introspection mode", (D, "5", INTROSPECTION_OPTION, "everyone"),
               (INTROSPECTION_OPTION, "everyone")),
    ConfigCase("introspection for operators without keys", (D, "5", INTROSPECTION_OPTION, "operators"),
               (INTROSPECTION_OPTION, "operators", "needs keys")),
    ConfigCase("admin keys without limits", (ADMIN_KEYS_OPTION, "{dir}/a.yaml"), (ADMIN_KEYS_OPTION,),
               (("a.yaml", "keys: {}\n"),)),
    ConfigCase("user label mode", (D, "5", LABEL_OPTION, "loud"), (LABEL_OPTION, "loud")),
    ConfigCase("hashed user label without a salt", (D, "5", LABEL_OPTION, "hashed"),
               (LABEL_OPTION, "hashed", SALT_OPTION)),
    ConfigCase("user label salt file missing", (D, "5", LABEL_OPTION, "hashed", SALT_OPTION, "{dir}/absent-salt"),
               (SALT_OPTION, "absent-salt")),
    ConfigCase("user label salt too short", (D, "5", LABEL_OPTION, "hashed", SALT_OPTION, "{dir}/salt"),
               (SALT_OPTION, "salt", "16 bytes"), (("salt", "abc\n"),)),
    ConfigCase("user label without limits", (LABEL_OPTION, "off"), (LABEL_OPTION,)),
    ConfigCase("prefill schedule interval", (D, "5", "--prefill-schedule-interval", "3"),
               ("--prefill-schedule-interval 3", D)),
)


def check_config_case(case: ConfigCase, model: str, scratch: Path) -> CaseResult:
    """Parse and check ``case``'s arguments as ``vllm-output-rate serve``
    does before it starts an engine; expect a refusal naming the option
    and the value."""
    import contextlib
    import io

    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from vllm_output_rate.internals import serve_cli

    for name, content in case.files:
        (scratch / name).write_text(content)
    args = [a.replace("{dir}", str(scratch)) for a in case.args]
    result = CaseResult("config", case.name, config_sends(case),
                        "refused at start-up, naming " + ", ".join(f"`{n}`" for n in case.names))
    t0 = time.perf_counter()
    err = io.StringIO()
    message = None
    try:
        parser = serve_cli()[0](FlexibleArgumentParser())
        with contextlib.redirect_stderr(err):
            parsed = parser.parse_args(["--model", model, "--skip-tokenizer-init",
                                        "--max-model-len", str(MAX_MODEL_LEN), *args])
        AsyncEngineArgs.from_cli_args(parsed).create_engine_config()
    except SystemExit:  # argparse: usage and the message on stderr
        message = err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else "argparse exit"
    except Exception as exc:  # noqa: BLE001 - what was refused, and how
        message = f"{type(exc).__name__}: {exc}"
    finally:
        from vllm_output_rate.frontend import forget_identity

        forget_identity()  # the next case checks its own options
    result.seconds = time.perf_counter() - t0
    if message is None:
        result.measured = "accepted"
        return result
    result.ok = all(n in message for n in case.names) and "Traceback" not in message
    result.measured = message.replace(str(scratch), "{dir}")[:300]
    return result


def config_sends(case: ConfigCase) -> str:
    """The case's arguments as typed, and what its files hold."""
    text = " ".join(_quote(a) for a in case.args)
    for name, content in case.files:
        text += f"; {name}: {content.strip()}"
    return text


def _quote(arg: str) -> str:
    return f"'{arg}'" if not arg or any(c in arg for c in " {}[]\"'") else arg


def serve_refuses(case: ConfigCase, model: str, scratch: Path, log_dir: Path) -> CaseResult:
    """The full profile: a real ``vllm-output-rate serve`` with ``case``'s
    arguments exits non-zero, and its output names what the case names."""
    import subprocess

    for name, content in case.files:
        (scratch / name).write_text(content)
    args = [a.replace("{dir}", str(scratch)) for a in case.args]
    result = CaseResult("config (real server)", case.name, config_sends(case),
                        "the server exits 2 before loading the model, naming "
                        + ", ".join(f"`{n}`" for n in case.names) + ", no traceback")
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-m", "vllm_output_rate.tools.cli", "serve", model,
                               "--max-model-len", str(MAX_MODEL_LEN), "--port", "0", *args],
                              capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired:
        result.measured = "still running after 180 s"
        return result
    result.seconds = time.perf_counter() - t0
    out = proc.stdout + proc.stderr
    log = log_dir / f"config-{case.name.replace(' ', '-')}.log"
    log.write_text(out)
    tail = [line for line in out.strip().splitlines() if line.strip()][-1:] or [""]
    result.measured = (f"exit {proc.returncode} after {result.seconds:.0f} s: "
                       + tail[0].replace(str(scratch), "{dir}")[:240])
    result.ok = proc.returncode == 2 and all(n in out for n in case.names) and "Traceback" not in out
    return result
