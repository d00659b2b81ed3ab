"""The scenario file of ``vllm-output-rate loadgen`` and ``verify`` (YAML
or JSON): users and their expected limits, prompts (literal, generated long
ones, shared prefixes for prefix-cache hits), the server's flags, the
checks' tolerances and phases of streams run one after the other. Each
stream: user, how many copies, prompt, ``max_tokens``, ``ignore_eos`` or an
early stop (EOS / ``stop_token_ids``), a client cancel after N tokens or T
seconds, a start time within its phase. ``parse_scenario`` names the file,
the field and the value of anything it refuses."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

from vllm_output_rate.config import (
    DEFAULT_OPTION,
    DEFAULT_OPTION_ALIAS,
    USERS_OPTION,
    USERS_OPTION_ALIAS,
)

from vllm_output_rate.tools.loadgen.prompts import _TOKENS_MARK, _tokens_mark, text_of_tokens

SCENARIO_DIR = Path(__file__).resolve().parent / "scenarios"
DEFAULT_SCENARIO = SCENARIO_DIR / "default.yaml"

#: The scenario spelling of a user without a limit (runs at the server's
#: default, which must be far above what the engine can do).
UNLIMITED = "unlimited"


class ScenarioError(ValueError):
    """A scenario file that cannot be used; the message names file, field and value."""


# -- schema ------------------------------------------------------------------------


@dataclass(frozen=True)
class Prompt:
    name: str
    text: str
    #: append " [request <seq>]" so that copies differ after a shared prefix
    unique: bool = False
    #: the prompt this one extends (prefix-cache hits), if any
    prefix: str | None = None


@dataclass(frozen=True)
class StreamSpec:
    user: str
    prompt: str
    max_tokens: int
    count: int = 1
    ignore_eos: bool = True
    stop_token_ids: tuple[int, ...] = ()
    cancel_after_tokens: int | None = None
    cancel_after_s: float | None = None
    start_s: float = 0.0
    temperature: float | None = None

    @property
    def cancels(self) -> bool:
        return self.cancel_after_tokens is not None or self.cancel_after_s is not None


@dataclass(frozen=True)
class Phase:
    name: str
    streams: tuple[StreamSpec, ...]
    #: pause after the phase before the next one starts
    gap_s: float = 1.0


@dataclass(frozen=True)
class ServerSpec:
    """How ``verify --model`` starts a server for this scenario."""

    default_limit: Fraction = Fraction(100_000)
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class CheckSpec:
    """Tolerances of the verifier's checks (see vllm_output_rate.tools.verify)."""

    rate_min_ratio: float = 0.97
    spacing_tolerance: float = 0.25
    unlimited_max_ratio: float = 1.5
    #: a throttled request may stall between two tokens at most 4 x its
    #: expected spacing (streams / limit) plus this many seconds
    stall_extra_s: float = 1.0
    baseline_phase: str | None = None
    compare_phase: str | None = None


@dataclass(frozen=True)
class Scenario:
    name: str
    path: str
    #: user -> expected limit in tok/s, None for unlimited
    users: dict[str, Fraction | None]
    prompts: dict[str, Prompt]
    phases: tuple[Phase, ...]
    server: ServerSpec = field(default_factory=ServerSpec)
    checks: CheckSpec = field(default_factory=CheckSpec)
    model_name: str = "tiny"
    timeout_s: float = 600.0
    request_timeout_s: float = 300.0

    def unlimited_users(self) -> list[str]:
        return [u for u, r in self.users.items() if r is None]

    def server_limits(self) -> dict[str, float]:
        """The per-user overrides a server for this scenario gets; unlimited
        users are listed at the default so that they have a metric label."""
        return {u: _num(r if r is not None else self.server.default_limit)
                for u, r in self.users.items()}

    def server_args(self, limits: dict[str, float] | None = None) -> list[str]:
        return [*self.server.args,
                DEFAULT_OPTION, str(_num(self.server.default_limit)),
                USERS_OPTION,
                json.dumps(limits if limits is not None else self.server_limits())]

    def expected_tokens(self) -> int:
        return sum(s.count * min(s.max_tokens, s.cancel_after_tokens or s.max_tokens)
                   for p in self.phases for s in p.streams)


def _num(x: Fraction) -> float | int:
    return int(x) if x.denominator == 1 else float(x)


class _Ctx:
    """Where we are in the file, for error messages."""

    def __init__(self, path: str) -> None:
        self.path = path

    def fail(self, where: str, msg: str, value: Any = ...) -> ScenarioError:
        shown = "" if value is ... else f" (got {_short(value)})"
        return ScenarioError(f"{self.path}: {where}: {msg}{shown}")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _mapping(ctx: _Ctx, where: str, value: Any, allowed: set[str], required: set[str] = set()) -> dict:
    if not isinstance(value, dict):
        raise ctx.fail(where, "expected a mapping", value)
    for key in value:
        if key not in allowed:
            raise ctx.fail(f"{where}.{key}" if where else str(key),
                           "unknown field; allowed: " + ", ".join(sorted(allowed)))
    for key in sorted(required):
        if key not in value:
            raise ctx.fail(where or "top level", f"missing required field {key!r}")
    return value


def _int(ctx: _Ctx, where: str, value: Any, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ctx.fail(where, f"expected an integer >= {minimum}", value)
    return value


def _float(ctx: _Ctx, where: str, value: Any, minimum: float = 0.0, strict: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value < minimum or (strict and value == minimum):
        op = ">" if strict else ">="
        raise ctx.fail(where, f"expected a number {op} {minimum}", value)
    return float(value)


def _bool(ctx: _Ctx, where: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ctx.fail(where, "expected true or false", value)
    return value


def _str(ctx: _Ctx, where: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ctx.fail(where, "expected a non-empty string", value)
    return value


def _rate(ctx: _Ctx, where: str, value: Any) -> Fraction:
    from vllm_output_rate.config import OutputRateConfigError, parse_rate

    try:
        return parse_rate(value, where)
    except OutputRateConfigError as exc:
        raise ctx.fail(where, f"expected a limit in tokens per second > 0 or {UNLIMITED!r}",
                       value) from exc


def _prompt(ctx: _Ctx, name: str, value: Any, raw: dict[str, Any], seen: tuple[str, ...] = ()) -> Prompt:
    where = f"prompts.{name}"
    if isinstance(value, str):
        if not value:
            raise ctx.fail(where, "a prompt must not be empty", value)
        return Prompt(name, value)
    m = _mapping(ctx, where, value, {"text", "tokens", "seed", "prefix", "unique"})
    if "text" in m and "tokens" in m:
        raise ctx.fail(where, "give either text or tokens, not both")
    if "text" in m:
        text = _str(ctx, f"{where}.text", m["text"])
    elif "tokens" in m:
        seed = _int(ctx, f"{where}.seed", m.get("seed", 0))
        text = _tokens_mark(_int(ctx, f"{where}.tokens", m["tokens"], 1), seed)
    elif "seed" in m:
        raise ctx.fail(f"{where}.seed", "seed needs tokens")
    else:
        text = ""
    prefix = None
    if "prefix" in m:
        prefix = _str(ctx, f"{where}.prefix", m["prefix"])
        if prefix not in raw:
            raise ctx.fail(f"{where}.prefix", "names no prompt of this scenario", prefix)
        if prefix == name or prefix in seen:
            raise ctx.fail(f"{where}.prefix", "prompts extend each other in a cycle", prefix)
        base = _prompt(ctx, prefix, raw[prefix], raw, (*seen, name))
        text = base.text + ("\n" + text if text else "")
    if not text:
        raise ctx.fail(where, "needs text, tokens or prefix")
    unique = _bool(ctx, f"{where}.unique", m.get("unique", False))
    return Prompt(name, text, unique, prefix)


def _stream(ctx: _Ctx, where: str, value: Any, users: dict, prompts: dict) -> StreamSpec:
    m = _mapping(ctx, where, value,
                 {"user", "prompt", "max_tokens", "count", "ignore_eos", "stop_token_ids",
                  "cancel_after_tokens", "cancel_after_s", "start_s", "temperature"},
                 {"user", "prompt", "max_tokens"})
    user = _str(ctx, f"{where}.user", m["user"])
    if user not in users:
        raise ctx.fail(f"{where}.user", "is not declared under users", user)
    prompt = _str(ctx, f"{where}.prompt", m["prompt"])
    if prompt not in prompts:
        raise ctx.fail(f"{where}.prompt", "names no prompt of this scenario", prompt)
    max_tokens = _int(ctx, f"{where}.max_tokens", m["max_tokens"], 1)
    stop = m.get("stop_token_ids", [])
    if not isinstance(stop, list):
        raise ctx.fail(f"{where}.stop_token_ids", "expected a list of token ids", stop)
    stop_ids = tuple(_int(ctx, f"{where}.stop_token_ids[{i}]", t) for i, t in enumerate(stop))
    ignore_eos = _bool(ctx, f"{where}.ignore_eos", m.get("ignore_eos", True))
    if stop_ids and ignore_eos:
        raise ctx.fail(f"{where}.stop_token_ids", "an early stop needs ignore_eos: false")
    cat = m.get("cancel_after_tokens")
    if cat is not None:
        cat = _int(ctx, f"{where}.cancel_after_tokens", cat, 1)
        if cat >= max_tokens:
            raise ctx.fail(f"{where}.cancel_after_tokens",
                           f"must be below max_tokens ({max_tokens}) or the stream never cancels",
                           cat)
    cas = m.get("cancel_after_s")
    if cas is not None:
        cas = _float(ctx, f"{where}.cancel_after_s", cas, 0.0, strict=True)
    temperature = m.get("temperature")
    if temperature is not None:
        temperature = _float(ctx, f"{where}.temperature", temperature)
    return StreamSpec(
        user=user, prompt=prompt, max_tokens=max_tokens,
        count=_int(ctx, f"{where}.count", m.get("count", 1), 1),
        ignore_eos=ignore_eos, stop_token_ids=stop_ids,
        cancel_after_tokens=cat, cancel_after_s=cas,
        start_s=_float(ctx, f"{where}.start_s", m.get("start_s", 0.0)),
        temperature=temperature,
    )


def parse_scenario(data: Any, path: str = "<scenario>") -> Scenario:
    """Validate a loaded scenario document; ScenarioError names file, field, value."""
    ctx = _Ctx(path)
    top = _mapping(ctx, "", data,
                   {"name", "description", "model_name", "timeout_s", "request_timeout_s",
                    "server", "users", "prompts", "phases", "checks"},
                   {"users", "prompts", "phases"})
    users_raw = top["users"]
    if not isinstance(users_raw, dict) or not users_raw:
        raise ctx.fail("users", "expected a non-empty mapping of user id -> limit (tok/s) "
                       f"or {UNLIMITED!r}", users_raw)
    users: dict[str, Fraction | None] = {}
    for user, limit in users_raw.items():
        where = f"users.{user}"
        if not isinstance(user, str) or not user:
            raise ctx.fail("users", "user ids must be non-empty strings", user)
        users[user] = None if limit == UNLIMITED else _rate(ctx, where, limit)
    prompts_raw = top["prompts"]
    if not isinstance(prompts_raw, dict) or not prompts_raw:
        raise ctx.fail("prompts", "expected a non-empty mapping of name -> prompt", prompts_raw)
    prompts = {str(n): _prompt(ctx, str(n), v, prompts_raw) for n, v in prompts_raw.items()}
    phases_raw = top["phases"]
    if not isinstance(phases_raw, list) or not phases_raw:
        raise ctx.fail("phases", "expected a non-empty list of phases", phases_raw)
    phases = []
    for i, p in enumerate(phases_raw):
        where = f"phases[{i}]"
        pm = _mapping(ctx, where, p, {"name", "streams", "gap_s"}, {"name", "streams"})
        name = _str(ctx, f"{where}.name", pm["name"])
        if any(ph.name == name for ph in phases):
            raise ctx.fail(f"{where}.name", "duplicate phase name", name)
        streams_raw = pm["streams"]
        if not isinstance(streams_raw, list) or not streams_raw:
            raise ctx.fail(f"{where}.streams", "expected a non-empty list of streams", streams_raw)
        streams = tuple(_stream(ctx, f"{where}.streams[{j}]", s, users, prompts)
                        for j, s in enumerate(streams_raw))
        phases.append(Phase(name, streams, _float(ctx, f"{where}.gap_s", pm.get("gap_s", 1.0))))

    server = ServerSpec()
    if "server" in top:
        sm = _mapping(ctx, "server", top["server"], {"default_limit", "args", "env"})
        args = sm.get("args", [])
        if not isinstance(args, list) or not all(isinstance(a, (str, int, float)) and not isinstance(a, bool)
                                                 for a in args):
            raise ctx.fail("server.args", "expected a list of command-line arguments", args)
        for a in args:
            if str(a).split("=")[0] in (DEFAULT_OPTION, DEFAULT_OPTION_ALIAS, USERS_OPTION,
                                        USERS_OPTION_ALIAS):
                raise ctx.fail("server.args", "limits come from users and server.default_limit, "
                               "not from args", a)
        env = sm.get("env", {})
        if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                for k, v in env.items()):
            raise ctx.fail("server.env", "expected a mapping of string -> string", env)
        server = ServerSpec(
            default_limit=_rate(ctx, "server.default_limit", sm.get("default_limit", 100_000)),
            args=tuple(str(a) for a in args), env=tuple(sorted(env.items())))

    checks = CheckSpec()
    if "checks" in top:
        cm = _mapping(ctx, "checks", top["checks"],
                      {"rate_min_ratio", "spacing_tolerance", "unlimited_max_ratio",
                       "stall_extra_s", "baseline_phase", "compare_phase"})
        names = [p.name for p in phases]
        for key in ("baseline_phase", "compare_phase"):
            if key in cm and cm[key] not in names:
                raise ctx.fail(f"checks.{key}", "names no phase of this scenario", cm[key])
        checks = CheckSpec(
            rate_min_ratio=_float(ctx, "checks.rate_min_ratio", cm.get("rate_min_ratio", 0.97)),
            spacing_tolerance=_float(ctx, "checks.spacing_tolerance", cm.get("spacing_tolerance", 0.25)),
            unlimited_max_ratio=_float(ctx, "checks.unlimited_max_ratio",
                                       cm.get("unlimited_max_ratio", 1.5), 1.0),
            stall_extra_s=_float(ctx, "checks.stall_extra_s", cm.get("stall_extra_s", 1.0)),
            baseline_phase=cm.get("baseline_phase"), compare_phase=cm.get("compare_phase"))
        if (checks.baseline_phase is None) != (checks.compare_phase is None):
            raise ctx.fail("checks", "baseline_phase and compare_phase go together")
        if checks.baseline_phase is not None and checks.baseline_phase == checks.compare_phase:
            raise ctx.fail("checks.compare_phase", "must differ from baseline_phase",
                           checks.compare_phase)

    return Scenario(
        name=_str(ctx, "name", top.get("name", Path(path).stem)),
        path=path, users=users, prompts=prompts, phases=tuple(phases),
        server=server, checks=checks,
        model_name=_str(ctx, "model_name", top.get("model_name", "tiny")),
        timeout_s=_float(ctx, "timeout_s", top.get("timeout_s", 600.0), 0.0, strict=True),
        request_timeout_s=_float(ctx, "request_timeout_s", top.get("request_timeout_s", 300.0),
                                 0.0, strict=True),
    )


def load_scenario(path: str | Path | None = None) -> Scenario:
    """Read and validate a scenario file (YAML or JSON); None: the built-in default."""
    p = Path(path) if path is not None else DEFAULT_SCENARIO
    try:
        text = p.read_text()
    except OSError as exc:
        raise ScenarioError(f"{p}: cannot read the scenario file ({exc.strerror or exc})") from None
    import yaml

    from vllm_output_rate.yaml_load import DuplicateKeyError, load_json, safe_load

    try:  # a key given twice is refused, naming both lines
        data = load_json(text, str(p)) if p.suffix == ".json" else safe_load(text, str(p))
    except DuplicateKeyError as exc:
        raise ScenarioError(str(exc)) from None
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        kind = "JSON" if p.suffix == ".json" else "YAML"
        raise ScenarioError(f"{p}: not valid {kind}: {exc}") from None
    return parse_scenario(data, str(p))


async def resolve_prompts(client: Any, base_url: str, scenario: Scenario) -> Scenario:
    """The scenario with every ``{tokens: N}`` prompt made for the server's
    tokenizer (prompts extending it get the same text)."""
    marks = {m.group(0): (int(m.group(1)), int(m.group(2)))
             for p in scenario.prompts.values() for m in _TOKENS_MARK.finditer(p.text)}
    if not marks:
        return scenario
    texts = {mark: await text_of_tokens(client, base_url, scenario.model_name, n, seed)
             for mark, (n, seed) in marks.items()}
    prompts = {}
    for name, prompt in scenario.prompts.items():
        text = _TOKENS_MARK.sub(lambda m: texts[m.group(0)], prompt.text)
        prompts[name] = dataclasses.replace(prompt, text=text)
    return dataclasses.replace(scenario, prompts=prompts)
