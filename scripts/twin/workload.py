"""The what-if twin's workloads: the JSON Lines format, its reader and the
built-in generators.

One JSON object a line (``WORKLOAD_SCHEMA``), times in seconds from the
start of the run (virtual time), sizes in tokens::

    {"t": 0.25, "user": "alice", "prompt_tokens": 512, "max_tokens": 128}
    {"t": 0.5, "user": "bob", "prompt_tokens": 64, "max_tokens": 32, "priority": 1}
    {"t": 30.0, "limits_file": "limits-after.yaml"}

A request line adds one request at ``t`` (it generates exactly
``max_tokens`` tokens: ``ignore_eos``); ``priority`` (optional, 0) is
vLLM's request priority, read with ``--scheduling-policy priority``. A limits line replaces the content
of the run's limits file with that file's (a path relative to the workload
file) at ``t``, as an operator editing it live: the scheduler's watcher
reads it then and puts it in force at the next step. Lines are taken in
time order (ties in file order); blank lines and lines starting with ``#``
are skipped. A bad line is refused with its number and field
(``workload.jsonl:7: max_tokens: expected a positive integer, got -3``).

Generators (``vllm-output-rate twin workload KIND --out FILE [params]
--seed N``), each deterministic given its seed:

* ``flood``: one user opens many streams at once beside steady users
  (Poisson arrivals);
* ``tiers``: users in named tiers (``free:4,gold:2``), each a Poisson
  source (tier names prefix the user ids: ``free-0``, ``gold-1``);
* ``bursts``: VTC's ``fair_bench`` shapes: a steady user beside one whose
  arrivals come on and off (``--on-s``/``--off-s``), overloading while on;
* ``clients``: many heterogeneous clients in the manner of ServeGen, each
  with its own arrival rate (log-normal across clients) and its own
  log-normal prompt and output lengths;
* ``long_prompts``: steady users, a request every ``1/--rate`` s each,
  beside one (``--flood-user``) sending ``--long-prompt-tokens`` prompts
  with ``--long-max-tokens`` out ``--long-rate`` times a second from
  ``--long-start`` (issue 48; the fairness benchmark's scenario).

``vllm-output-rate twin workload burstgpt --trace FILE.csv --out FILE
--users RULE`` converts a BurstGPT trace (columns ``Timestamp, Model,
Request tokens, Response tokens, Total tokens, Log Type``; ``Timestamp`` in
seconds) into a workload: a row is a request at its timestamp (from the
first row's, times ``--time-scale``) with ``Request tokens`` as the prompt
and ``Response tokens`` as ``max_tokens``; rows with 0 response tokens (the
trace's failures) are skipped. The trace names no users, so they are
assigned by a stated rule (``BURSTGPT_RULES``), deterministic given
``--seed``.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import itertools
import json
import math
import os
import random
import sys
from dataclasses import dataclass
from typing import Any

from vllm_output_rate.yaml_load import DuplicateKeyError, load_json

_POSITIVE_INT = {"type": "integer", "minimum": 1}
_TIME = {"type": "number", "minimum": 0, "description": "seconds from the start of the run"}

WORKLOAD_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "vllm-output-rate twin workload line",
    "oneOf": [
        {"title": "request", "type": "object", "additionalProperties": False,
         "required": ["t", "user", "prompt_tokens", "max_tokens"],
         "properties": {"t": _TIME, "user": {"type": "string", "minLength": 1},
                        "prompt_tokens": _POSITIVE_INT, "max_tokens": _POSITIVE_INT,
                        "priority": {"type": "integer", "default": 0, "description":
                                     "vLLM's request priority (lower first; read with "
                                     "--scheduling-policy priority)"}}},
        {"title": "limits change", "type": "object", "additionalProperties": False,
         "required": ["t", "limits_file"],
         "properties": {"t": _TIME, "limits_file": {
             "type": "string", "minLength": 1,
             "description": "a limits file (relative to the workload file) whose "
                            "content replaces the run's limits file at t"}}},
    ],
}

REQUEST_FIELDS = ("t", "user", "prompt_tokens", "max_tokens")
#: a request line's optional fields
REQUEST_OPTIONAL = ("priority",)
LIMITS_FIELDS = ("t", "limits_file")


class WorkloadError(ValueError):
    """A workload line that does not follow the schema."""


@dataclass(frozen=True)
class WorkloadRequest:
    t: float
    user: str
    prompt_tokens: int
    max_tokens: int
    line: int
    #: vLLM's request priority (lower first; with --scheduling-policy priority)
    priority: int = 0


@dataclass(frozen=True)
class LimitsChangeAt:
    t: float
    #: the file whose content becomes the limits file's, and its content
    path: str
    content: bytes
    line: int


@dataclass
class Workload:
    path: str
    #: requests and limits changes, in time order (ties in file order)
    events: list[WorkloadRequest | LimitsChangeAt]

    @property
    def requests(self) -> list[WorkloadRequest]:
        return [e for e in self.events if isinstance(e, WorkloadRequest)]

    @property
    def limits_changes(self) -> list[LimitsChangeAt]:
        return [e for e in self.events if isinstance(e, LimitsChangeAt)]


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def parse_line(obj: Any, where: str, base_dir: str, line: int) -> WorkloadRequest | LimitsChangeAt:
    """One parsed line, checked (``where``: ``file:line`` for messages)."""
    if not isinstance(obj, dict):
        raise WorkloadError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    if "t" not in obj:
        raise WorkloadError(f"{where}: t: missing")
    t = obj["t"]
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
        raise WorkloadError(f"{where}: t: expected a number of seconds >= 0, got {t!r}")
    fields = LIMITS_FIELDS if "limits_file" in obj else REQUEST_FIELDS
    known = fields if fields is LIMITS_FIELDS else REQUEST_FIELDS + REQUEST_OPTIONAL
    for key in obj:
        if key not in known:
            kind = "a limits line" if fields is LIMITS_FIELDS else "a request line"
            raise WorkloadError(f"{where}: {key}: unknown field in {kind} "
                                f"(fields: {', '.join(known)})")
    for key in fields:
        if key not in obj:
            raise WorkloadError(f"{where}: {key}: missing")
    if fields is LIMITS_FIELDS:
        name = obj["limits_file"]
        if not isinstance(name, str) or not name:
            raise WorkloadError(f"{where}: limits_file: expected a file name, got {name!r}")
        path = os.path.join(base_dir, name)
        try:
            with open(path, "rb") as f:
                content = f.read()
        except OSError as exc:
            raise WorkloadError(f"{where}: limits_file: cannot read {name!r} "
                                f"({exc.strerror or exc})") from None
        return LimitsChangeAt(float(t), path, content, line)
    user = obj["user"]
    if not isinstance(user, str) or not user:
        raise WorkloadError(f"{where}: user: expected a non-empty string, got {user!r}")
    for key in ("prompt_tokens", "max_tokens"):
        if not _positive_int(obj[key]):
            raise WorkloadError(f"{where}: {key}: expected a positive integer, got {obj[key]!r}")
    priority = obj.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise WorkloadError(f"{where}: priority: expected an integer, got {priority!r}")
    return WorkloadRequest(float(t), user, obj["prompt_tokens"], obj["max_tokens"], line,
                           priority)


def read_workload(path: str) -> Workload:
    """The workload in ``path``; ``WorkloadError`` names the first bad line."""
    try:
        with open(path) as f:
            lines = f.read().split("\n")
    except OSError as exc:
        raise WorkloadError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    base_dir = os.path.dirname(os.path.abspath(path))
    events = []
    for i, text in enumerate(lines, 1):
        text = text.strip()
        if not text or text.startswith("#"):
            continue
        where = f"{path}:{i}"
        try:
            obj = load_json(text, path, i)
        except DuplicateKeyError as exc:  # a field given twice, named
            raise WorkloadError(str(exc)) from None
        except ValueError as exc:
            raise WorkloadError(f"{where}: not JSON ({exc})") from None
        events.append(parse_line(obj, where, base_dir, i))
    return _workload(path, events)


def workload_of_lines(lines: list[dict[str, Any]], name: str = "workload.jsonl",
                      base_dir: str = ".") -> Workload:
    """A workload from its lines in memory (each checked as a file's line
    is; ``name`` stands for the file in messages and in the summary, limits
    lines are read relative to ``base_dir``)."""
    return _workload(name, [parse_line(obj, f"{name}:{i}", base_dir, i)
                            for i, obj in enumerate(lines, 1)])


def _workload(path: str, events: list[WorkloadRequest | LimitsChangeAt]) -> Workload:
    if not any(isinstance(e, WorkloadRequest) for e in events):
        raise WorkloadError(f"{path}: no request lines")
    events.sort(key=lambda e: (e.t, e.line))
    return Workload(path, events)


# --------------------------------------------------------------------------- generators


def _poisson(rng: random.Random, rate: float, start: float, end: float):
    """Arrival times of a Poisson process of ``rate``/s over [start, end)."""
    t = start
    while rate > 0:
        t += rng.expovariate(rate)
        if t >= end:
            return
        yield t


def _lognormal_int(rng: random.Random, mean: float, sigma: float, cap: int) -> int:
    """A log-normal integer with about this mean, in [1, cap]."""
    mu = math.log(max(mean, 1.0)) - sigma * sigma / 2
    return max(1, min(cap, round(rng.lognormvariate(mu, sigma))))


def _request(t: float, user: str, prompt: int, max_tokens: int) -> dict[str, Any]:
    return {"t": round(t, 6), "user": user, "prompt_tokens": prompt, "max_tokens": max_tokens}


def gen_flood(rng: random.Random, a: argparse.Namespace) -> list[dict[str, Any]]:
    out = [_request(rng.uniform(0, 0.1), a.flood_user, a.prompt_tokens, a.flood_max_tokens)
           for _ in range(a.streams)]
    for i in range(a.users):
        for t in _poisson(rng, a.rate, 0.0, a.duration):
            out.append(_request(t, f"steady-{i}", a.prompt_tokens, a.max_tokens))
    return out


def gen_tiers(rng: random.Random, a: argparse.Namespace) -> list[dict[str, Any]]:
    out = []
    for spec in a.tiers.split(","):
        name, _, count = spec.partition(":")
        if not name or not count.isdigit():
            raise WorkloadError(f"--tiers: expected NAME:COUNT[,NAME:COUNT...], got {spec!r}")
        for i in range(int(count)):
            for t in _poisson(rng, a.rate, 0.0, a.duration):
                out.append(_request(t, f"{name}-{i}", a.prompt_tokens, a.max_tokens))
    return out


def gen_bursts(rng: random.Random, a: argparse.Namespace) -> list[dict[str, Any]]:
    out = [_request(t, "steady", a.prompt_tokens, a.max_tokens)
           for t in _poisson(rng, a.rate, 0.0, a.duration)]
    start = 0.0
    while start < a.duration:
        end = min(start + a.on_s, a.duration)
        out += [_request(t, "bursty", a.prompt_tokens, a.max_tokens)
                for t in _poisson(rng, a.burst_rate, start, end)]
        start += a.on_s + a.off_s
    return out


def gen_clients(rng: random.Random, a: argparse.Namespace) -> list[dict[str, Any]]:
    out = []
    sigma = 1.0
    for i in range(a.clients):
        rate = a.rate * rng.lognormvariate(-sigma * sigma / 2, sigma)
        prompt_mean = a.prompt_tokens * rng.lognormvariate(-0.125, 0.5)
        output_mean = a.max_tokens * rng.lognormvariate(-0.125, 0.5)
        for t in _poisson(rng, rate, 0.0, a.duration):
            out.append(_request(t, f"client-{i}", _lognormal_int(rng, prompt_mean, 0.6, a.cap),
                                _lognormal_int(rng, output_mean, 0.6, a.cap)))
    return out


def long_prompt_lines(rng: random.Random, steady: int, every_s: float, prompt: int,
                      max_tokens: int, long_users: list[str], long_prompt: int,
                      long_max_tokens: int, per_s: float, start_s: float,
                      duration: float) -> list[dict[str, Any]]:
    """Long prompts, short answers (issue 48): ``steady`` users each sending
    a request every ``every_s`` seconds (from a random phase), and each of
    ``long_users`` a ``long_prompt``-token prompt with ``long_max_tokens``
    out ``per_s`` times a second from ``start_s`` (the fairness benchmark's
    ``long_prompts`` scenario)."""
    out = []
    for i in range(steady):
        t = rng.uniform(0.0, every_s)
        while t < duration:
            out.append(_request(t, f"steady-{i}", prompt, max_tokens))
            t += every_s
    for user in long_users:
        t = start_s + rng.uniform(0.0, 1.0 / per_s)
        while t < duration:
            out.append(_request(t, user, long_prompt, long_max_tokens))
            t += 1.0 / per_s
    return out


def gen_long_prompts(rng: random.Random, a: argparse.Namespace) -> list[dict[str, Any]]:
    return long_prompt_lines(rng, a.users, 1.0 / a.rate, a.prompt_tokens, a.max_tokens,
                             [a.flood_user], a.long_prompt_tokens, a.long_max_tokens,
                             a.long_rate, a.long_start, a.duration)


GENERATORS = {
    "flood": (gen_flood, "one user opens many streams at once beside steady Poisson users"),
    "tiers": (gen_tiers, "users in named tiers, each a Poisson source"),
    "bursts": (gen_bursts, "a steady user beside an on/off bursty one (VTC fair_bench shapes)"),
    "clients": (gen_clients, "many clients, each with its own arrival rate and length "
                             "distributions (log-normal)"),
    "long_prompts": (gen_long_prompts, "steady users beside one sending long prompts with short "
                                       "answers several times a second (issue 48)"),
}


def generate(kind: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The lines of a generated workload, in time order."""
    lines = GENERATORS[kind][0](random.Random(args.seed), args)
    lines.sort(key=lambda d: d["t"])
    return lines


def add_generator_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("kind", choices=list(GENERATORS))
    parser.add_argument("--out", required=True, help="the workload file to write (JSON Lines)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals")
    parser.add_argument("--rate", type=float, default=1.0,
                        help="requests/s of each steady user, tier user or bursty user's "
                             "steady neighbour; mean rate per client (clients)")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--users", type=int, default=3, help="steady users (flood)")
    parser.add_argument("--flood-user", default="flooder")
    parser.add_argument("--streams", type=int, default=32, help="the flooding user's streams")
    parser.add_argument("--flood-max-tokens", type=int, default=1024)
    parser.add_argument("--tiers", default="free:4,gold:2", help="NAME:COUNT,... (tiers)")
    parser.add_argument("--burst-rate", type=float, default=8.0, help="requests/s while on")
    parser.add_argument("--on-s", type=float, default=10.0)
    parser.add_argument("--off-s", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--cap", type=int, default=4096,
                        help="largest prompt or output length drawn (clients)")
    parser.add_argument("--long-prompt-tokens", type=int, default=3800,
                        help="the long prompts (long_prompts; steady users: --users, --rate, "
                        "a request every 1/rate s, --prompt-tokens, --max-tokens)")
    parser.add_argument("--long-max-tokens", type=int, default=20)
    parser.add_argument("--long-rate", type=float, default=4.0,
                        help="long prompts a second (long_prompts)")
    parser.add_argument("--long-start", type=float, default=2.0,
                        help="when the long prompts start (s)")


# --------------------------------------------------------------------------- BurstGPT

BURSTGPT_COLUMNS = ("Timestamp", "Model", "Request tokens", "Response tokens", "Total tokens",
                    "Log Type")
BURSTGPT_RULES = {
    "hash:N": "user-K, K a hash of the row's index and the seed, modulo N: an even share",
    "zipf:N:S": "user-K, K drawn with weight 1/(K+1)^S over N users: user-0 the heaviest",
    "column:NAME": "the row's value in column NAME (Model, Log Type), spaces as '-'",
}


def user_rule(spec: str, seed: int):
    """``row index, row -> user`` of a ``--users`` rule (``BURSTGPT_RULES``)."""
    kind, _, rest = spec.partition(":")
    parts = rest.split(":") if rest else []
    try:
        if kind == "hash" and len(parts) == 1 and int(parts[0]) >= 1:
            n = int(parts[0])

            def by_hash(index: int, row: dict[str, str]) -> str:
                digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
                return f"user-{int.from_bytes(digest, 'big') % n}"

            return by_hash
        if kind == "zipf" and len(parts) == 2 and int(parts[0]) >= 1 and float(parts[1]) >= 0:
            n, s = int(parts[0]), float(parts[1])
            cum = list(itertools.accumulate(1.0 / (k + 1) ** s for k in range(n)))
            rng = random.Random(seed)
            names = [f"user-{k}" for k in range(n)]
            return lambda index, row: rng.choices(names, cum_weights=cum)[0]
    except ValueError:
        pass
    if kind == "column" and rest:
        if rest not in BURSTGPT_COLUMNS:
            raise WorkloadError(f"--users {spec}: no column {rest!r} "
                                f"(columns: {', '.join(BURSTGPT_COLUMNS)})")
        return lambda index, row: (row.get(rest) or "unknown").strip().replace(" ", "-")
    raise WorkloadError(f"--users {spec}: expected one of {', '.join(BURSTGPT_RULES)} "
                        f"(N >= 1 users, S >= 0)")


def convert_burstgpt(path: str, users: str, seed: int = 0, limit_rows: int | None = None,
                     time_scale: float = 1.0, max_len: int | None = None,
                     model: str | None = None) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """The workload lines of a BurstGPT CSV and the counts of rows read,
    kept, skipped (failures, another model) and clipped (``max_len``)."""
    rule = user_rule(users, seed)
    counts = {"rows": 0, "kept": 0, "failed": 0, "other_model": 0, "clipped": 0}
    out: list[dict[str, Any]] = []
    try:
        f = open(path, newline="")
    except OSError as exc:
        raise WorkloadError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    with f:
        reader = csv.DictReader(f)
        header = [h.strip() for h in reader.fieldnames or []]
        reader.fieldnames = header
        for need in ("Timestamp", "Request tokens", "Response tokens"):
            if need not in header:
                raise WorkloadError(f"{path}:1: {need}: missing column (a BurstGPT trace has "
                                    f"{', '.join(BURSTGPT_COLUMNS)})")
        t0 = None
        for index, row in enumerate(reader):
            line = index + 2
            if limit_rows is not None and counts["kept"] >= limit_rows:
                break
            counts["rows"] += 1
            try:
                ts = float(row["Timestamp"])
                prompt = int(float(row["Request tokens"]))
                output = int(float(row["Response tokens"]))
            except (TypeError, ValueError):
                raise WorkloadError(f"{path}:{line}: Timestamp, Request tokens, Response tokens: "
                                    f"expected numbers, got {row.get('Timestamp')!r}, "
                                    f"{row.get('Request tokens')!r}, "
                                    f"{row.get('Response tokens')!r}") from None
            if model is not None and (row.get("Model") or "").strip() != model:
                counts["other_model"] += 1
                continue
            if output < 1 or prompt < 1:
                counts["failed"] += 1
                continue
            if t0 is None:
                t0 = ts
            if ts < t0:
                raise WorkloadError(f"{path}:{line}: Timestamp: {ts:g} is before the first "
                                    f"row's {t0:g} (the trace must be in time order)")
            if max_len is not None and prompt + output > max_len:
                output = min(output, max(1, max_len // 2))
                prompt = min(prompt, max_len - output)
                counts["clipped"] += 1
            out.append(_request((ts - t0) * time_scale, rule(index, row), prompt, output))
            counts["kept"] += 1
    if not out:
        raise WorkloadError(f"{path}: no usable rows ({counts})")
    return out, counts


def burstgpt_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="vllm-output-rate twin workload burstgpt",
        description="Convert a BurstGPT trace (CSV) into a twin workload, users assigned by "
                    "a rule.")
    parser.add_argument("--trace", required=True, help="the BurstGPT CSV")
    parser.add_argument("--out", required=True, help="the workload file to write (JSON Lines)")
    parser.add_argument("--users", required=True,
                        help="how rows become users: " + "; ".join(
                            f"{k}: {v}" for k, v in BURSTGPT_RULES.items()))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--limit-rows", type=int, default=None,
                        help="keep at most this many requests (the trace's first)")
    parser.add_argument("--time-scale", type=float, default=1.0,
                        help="multiply the trace's times (0.1: ten times the arrival rate)")
    parser.add_argument("--max-len", type=int, default=None,
                        help="clip a request longer than this (prompt + output tokens): "
                             "output to at most half, then the prompt")
    parser.add_argument("--model", default=None, help="keep only rows of this Model (ChatGPT, GPT-4)")
    args = parser.parse_args(argv)
    if args.time_scale <= 0:
        parser.error("--time-scale: expected a number > 0")
    if args.limit_rows is not None and args.limit_rows < 1:
        parser.error("--limit-rows: expected a positive integer")
    if args.max_len is not None and args.max_len < 2:
        parser.error("--max-len: expected an integer >= 2")
    try:
        lines, counts = convert_burstgpt(args.trace, args.users, args.seed, args.limit_rows,
                                         args.time_scale, args.max_len, args.model)
    except WorkloadError as exc:
        print(f"vllm-output-rate twin workload burstgpt: error: {exc}", file=sys.stderr)
        return 2
    lines.sort(key=lambda d: d["t"])
    write_workload(args.out, lines)
    users = len({line["user"] for line in lines})
    print(f"{args.out}: {len(lines)} requests of {users} users over {lines[-1]['t']:g} s "
          f"(rows read {counts['rows']}, failures skipped {counts['failed']}, other model "
          f"{counts['other_model']}, clipped {counts['clipped']})")
    return 0


def write_workload(path: str, lines: list[dict[str, Any]]) -> None:
    with open(path, "w") as f:
        f.writelines(json.dumps(line) + "\n" for line in lines)


def main(argv: list[str]) -> int:
    if argv[:1] == ["burstgpt"]:
        return burstgpt_main(argv[1:])
    parser = argparse.ArgumentParser(prog="vllm-output-rate twin workload",
                                     description="Write a generated twin workload (JSON Lines).")
    add_generator_args(parser)
    args = parser.parse_args(argv)
    for name in ("duration", "rate", "burst_rate", "on_s"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')}: expected a number > 0")
    for name in ("prompt_tokens", "max_tokens", "streams", "flood_max_tokens", "clients", "cap"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: expected a positive integer")
    try:
        lines = generate(args.kind, args)
    except WorkloadError as exc:
        parser.error(str(exc))
    write_workload(args.out, lines)
    users = len({line["user"] for line in lines})
    print(f"{args.out}: {len(lines)} requests of {users} users over {args.duration:g} s "
          f"({args.kind}, seed {args.seed})")
    return 0
